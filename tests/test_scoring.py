"""MathVista rule-based scoring on hand-made cases; MM-Vet per-capability tables and the grader hook."""

import json
import os
from collections import Counter
from pathlib import Path

import pandas as pd
import pytest

from workbench.datasets import scoring
from workbench.datasets.scoring import (MMVetGraderMissing, mmvet_capability_table, register_mmvet_grader,
                                        score_mathvista)
from workbench.prompts import Prompt

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("WORKBENCH_SHARED_DATA", REPO.parent / "shared" / "data"))

DEG = {"question_type": "multi_choice", "answer_type": "text", "choices": ["135°", "140°", "145°", "150°"],
       "unit": None, "precision": None, "answer": "145°"}
TIME = {"question_type": "multi_choice", "answer_type": "text",
        "choices": ["half", "quarter", "o'clock", "quarter to", "quarter past"],
        "unit": None, "precision": None, "answer": "quarter"}
NUMS = {"question_type": "multi_choice", "answer_type": "text", "choices": ["97", "102", "107", "122"],
        "unit": None, "precision": None, "answer": "97"}
CM = {"question_type": "multi_choice", "answer_type": "text", "choices": ["6cm", "7cm", "4cm", "5cm"],
      "unit": None, "precision": None, "answer": "6cm"}
GRAMS = {"question_type": "free_form", "answer_type": "integer", "choices": None, "unit": "g",
         "precision": None, "answer": "1000"}
INT = {"question_type": "free_form", "answer_type": "integer", "choices": None, "unit": None,
       "precision": None, "answer": "12"}
NEG = dict(INT, answer="-5")
YEARS = dict(INT, unit="years", answer="4")
F1 = {"question_type": "free_form", "answer_type": "float", "choices": None, "unit": None,
      "precision": 1, "answer": "1.2"}
F2 = dict(F1, precision=2, answer="51.04")
LIST = {"question_type": "free_form", "answer_type": "list", "choices": None, "unit": None,
        "precision": None, "answer": "[2014, 2016]"}
LONG_LIST = dict(LIST, answer="[0, 2, 0, 2, 1, 7, 1, 2, 0, 3, 0, 6]")

CASES = [
    # multiple choice: letters in their usual dresses
    (DEG, "C", "145°", True),
    (DEG, "(C)", "145°", True),
    (DEG, "Answer: C", "145°", True),
    (DEG, "**Answer:** (C) 145°", "145°", True),
    (DEG, "The answer is (C) 145°.", "145°", True),
    (DEG, "So ∠BOC = 145°, and the correct option is C.", "145°", True),
    (DEG, "Therefore $\\boxed{C}$", "145°", True),
    (DEG, "B", "140°", False),
    (DEG, "<think>Maybe (A)? No.</think>\nAnswer: C", "145°", True),
    (DEG, "Both bisectors meet at O.\nC. 145°", "145°", True),
    # multiple choice: choice text instead of a letter
    (DEG, "∠BOC = 145°", "145°", True),
    (DEG, "The answer is 145^\\circ.", "145°", True),
    (DEG, "A triangle's angles add to 180°, so ∠BOC is 150°", "150°", False),
    (TIME, "Answer: quarter", "quarter", True),
    (TIME, "It is quarter past eight.", "quarter past", False),
    (TIME, "The final answer is: quater", "quarter", True),  # closest choice text
    (NUMS, "Answer: 97", "97", True),
    (NUMS, "m∠H = 107", "107", False),
    (CM, "The length of AC is 6 cm.", "6cm", True),
    # integers, units stripped
    (GRAMS, "The cup holds 1000 g.", 1000, True),
    (GRAMS, "Answer: 1,000g", 1000, True),
    (GRAMS, "\\boxed{1000}", 1000, True),
    (GRAMS, "Answer: 999 g", 999, False),
    (INT, "The area is 3*4 = 12 cm^2", 12, True),
    (INT, "Answer: 12 (since 3*4=12, plus nothing)", 12, True),
    (INT, "The answer is 12.0", 12, True),
    (INT, "There are twelve.", 12, True),
    (INT, "Answer: 12.5", 12.5, False),
    (NEG, "x = −5", -5, True),
    (YEARS, "The age gap is 4 years.", 4, True),
    # floats at the problem's precision
    (F1, "d = 1.2 m", 1.2, True),
    (F1, "Answer: 1.24", 1.2, True),
    (F1, "Answer: 1.25", 1.3, False),
    (F1, "d = 6/5 m", 1.2, True),
    (F1, "The answer is \\frac{6}{5}", 1.2, True),
    (F1, "Answer: 12", 12.0, False),
    (F2, "51.04", 51.04, True),
    (F2, "Answer: 51.035", 51.04, True),
    (F2, "Answer: 51.0", 51.0, False),
    # lists
    (LIST, "The years are [2014, 2016].", [2014, 2016], True),
    (LIST, "Answer: 2014, 2016", [2014, 2016], True),
    (LIST, "Answer: [2016, 2014]", [2016, 2014], False),
    (LIST, "Answer: [2014]", [2014], False),
    (LONG_LIST, "Chain code:\n[0, 2, 0, 2, 1, 7, 1, 2, 0, 3, 0, 6]", [0, 2, 0, 2, 1, 7, 1, 2, 0, 3, 0, 6], True),
    # nothing to read
    (INT, "", None, False),
    (LIST, "I cannot tell.", None, False),
]


@pytest.mark.parametrize("meta, text, extracted, correct", CASES,
                         ids=[f"{m['answer_type']}-{i}" for i, (m, *_ ) in enumerate(CASES)])
def test_score_mathvista_hand_made(meta, text, extracted, correct):
    result = score_mathvista(text, meta)
    assert result["extracted"] == extracted
    assert result["correct"] is correct


def test_cases_cover_every_question_and_answer_type():
    kinds = {(m["question_type"], m["answer_type"], m["precision"]) for m, *_ in CASES}
    assert kinds >= {("multi_choice", "text", None), ("free_form", "integer", None), ("free_form", "float", 1),
                     ("free_form", "float", 2), ("free_form", "list", None)}


def test_how_the_answer_was_found_is_reported():
    assert score_mathvista("The length of AC is 6 cm.", CM)["method"] == "tail:text"
    assert score_mathvista("Answer: (B)", CM)["method"] == "marker:letter"
    assert score_mathvista("The final answer is: quater", TIME)["method"] == "marker:closest"
    assert score_mathvista("\\boxed{1000}", GRAMS)["method"] == "boxed:number"


def test_float_extraction_is_rounded_to_the_precision():
    assert score_mathvista("about 3.14159", dict(F2, answer="3.14"))["extracted"] == 3.14
    assert score_mathvista("about 3.14159", dict(F1, answer="3.1"))["extracted"] == 3.1


def test_bad_meta_is_reported():
    with pytest.raises(ValueError, match="without choices"):
        score_mathvista("A", dict(DEG, choices=None))
    with pytest.raises(ValueError, match="unknown MathVista answer_type"):
        score_mathvista("1", dict(INT, answer_type="complex"))
    with pytest.raises(ValueError, match="no reference 'answer'"):
        score_mathvista("1", dict(INT, answer=None))


def _testmini():
    path = SHARED / "mathvista" / "testmini.json"
    if not path.is_file():
        pytest.skip(f"MathVista testmini not found at {path}")
    return json.loads(path.read_text())


def test_every_testmini_reference_scores_correct_and_a_wrong_answer_does_not():
    """For all 1000 problems: the reference in two phrasings is correct; a wrong value is not."""
    failures = []
    for pid, rec in _testmini().items():
        meta = {k: rec[k] for k in ("question_type", "answer_type", "choices", "unit", "precision", "answer")}
        if rec["question_type"] == "multi_choice":
            i = rec["choices"].index(rec["answer"])
            right = [f"Answer: {'ABCDEFGH'[i]}", f"The answer is ({'ABCDEFGH'[i]}) {rec['answer']}"]
            # a few problems repeat a choice text; the wrong letter must point at a different text
            j = next(j for j, c in enumerate(rec["choices"]) if c != rec["answer"])
            wrong = f"Answer: {'ABCDEFGH'[j]}"
        elif rec["answer_type"] == "list":
            right = [f"Answer: {rec['answer']}", f"So the result is {rec['answer']}"]
            wrong = "Answer: [1, 2, 3]"
        else:
            unit = f" {rec['unit']}" if rec["unit"] else ""
            right = [f"The answer is {rec['answer']}{unit}.", f"Working... \\boxed{{{rec['answer']}}}"]
            wrong = f"The answer is {float(rec['answer']) + 1}{unit}."
        for text in right:
            if not score_mathvista(text, meta)["correct"]:
                failures.append((pid, text, score_mathvista(text, meta)))
        if score_mathvista(wrong, meta)["correct"]:
            failures.append((pid, wrong, "wrong answer scored correct"))
    assert failures == []


# --------------------------------------------------------------------------- MM-Vet

def _mmvet_prompts():
    return [
        Prompt("a", "What is x?", [], "mmvet", {"answer": "-1<AND>-5", "capability": ["ocr", "math"]}),
        Prompt("b", "What is shown?", [], "mmvet", {"answer": "a cat", "capability": ["rec"]}),
        Prompt("c", "Where is it?", [], "mmvet", {"answer": "left", "capability": ["rec", "spat"]}),
    ]


@pytest.fixture
def no_grader():
    previous = scoring.get_mmvet_grader()
    register_mmvet_grader(None)
    yield
    register_mmvet_grader(previous)


def test_capability_table_counts_each_capability_and_averages_values(no_grader):
    records = pd.DataFrame({"pid": ["a", "b", "c"], "tok_s": [10.0, 20.0, 40.0]})
    table = mmvet_capability_table(records, prompts=_mmvet_prompts(), values=["tok_s"]).set_index("capability")
    assert table.loc["rec", "n"] == 2 and table.loc["rec", "tok_s"] == 30.0
    assert table.loc["ocr", "n"] == 1 and table.loc["math", "tok_s"] == 10.0
    assert table.loc["total", "n"] == 3 and table.loc["total", "tok_s"] == pytest.approx(70 / 3)
    combos = mmvet_capability_table(records, prompts=_mmvet_prompts(), by="combination").set_index("combination")
    assert set(combos.index) == {"math,ocr", "rec", "rec,spat", "total"}


def test_scores_without_a_grader_raise_a_clear_error(no_grader):
    records = [{"pid": "a", "text": "x = -1 or -5"}]
    with pytest.raises(MMVetGraderMissing, match="register_mmvet_grader"):
        mmvet_capability_table(records, prompts=_mmvet_prompts(), scores=True)


def test_registered_grader_is_called_and_checked(no_grader):
    calls = []

    def grader(question, answer, prediction, meta):
        calls.append((question, answer, prediction))
        return 1.0 if prediction.strip() == answer else 0.0

    register_mmvet_grader(grader)
    records = [{"pid": "a", "text": "-1<AND>-5"}, {"pid": "b", "text": "a dog"}, {"pid": "c", "text": "left"}]
    table = mmvet_capability_table(records, prompts=_mmvet_prompts(), scores=True).set_index("capability")
    assert table.loc["ocr", "score"] == 1.0 and table.loc["rec", "score"] == 0.5
    assert table.loc["total", "score"] == pytest.approx(2 / 3)
    assert calls[0] == ("What is x?", "-1<AND>-5", "-1<AND>-5")
    register_mmvet_grader(lambda *a: 1.5)
    with pytest.raises(ValueError, match=r"outside \[0, 1\]"):
        mmvet_capability_table(records, prompts=_mmvet_prompts(), scores=True)


def test_capability_table_on_the_real_mmvet_copy(no_grader):
    path = SHARED / "mm-vet" / "mm-vet.json"
    if not path.is_file():
        pytest.skip(f"MM-Vet not found at {path}")
    from workbench.datasets import load_mmvet

    prompts = load_mmvet(path.parent, check_images=False)
    expected = Counter(c for rec in json.loads(path.read_text()).values() for c in rec["capability"])
    table = mmvet_capability_table([{"pid": p.pid} for p in prompts], prompts=prompts).set_index("capability")
    assert {k: int(table.loc[k, "n"]) for k in expected} == dict(expected)
    assert table.loc["total", "n"] == 218


def test_capability_table_errors_name_the_record(no_grader):
    with pytest.raises(KeyError, match="'zz'"):
        mmvet_capability_table([{"pid": "zz"}], prompts=_mmvet_prompts())
    with pytest.raises(ValueError, match="'q': no capability"):
        mmvet_capability_table([{"pid": "q"}])
