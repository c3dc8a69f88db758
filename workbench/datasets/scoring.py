"""Answer scoring: rule-based for MathVista (no model needed), a grader hook for MM-Vet.

MathVista: the answer is located (after a reasoning model's `</think>`, in the
last `\\boxed{}`, after the last "answer is" / "Answer:", else at the end of the
text), then read according to the problem's question and answer type.
MM-Vet answers are open-ended and need a model grader; none is built in, so
scores exist only once one is registered with `register_mmvet_grader`.
"""

from __future__ import annotations

import difflib
import re
from decimal import ROUND_HALF_UP, Decimal, InvalidOperation
from typing import Any, Callable, Iterable, Mapping

__all__ = [
    "extract_mathvista_answer",
    "score_mathvista",
    "register_mmvet_grader",
    "get_mmvet_grader",
    "grade_mmvet",
    "mmvet_capability_table",
    "MMVetGraderMissing",
]

_LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"

# --------------------------------------------------------------------------- locating the answer

_MARKER = re.compile(
    r"(?:final\s+answer|correct\s+(?:answer|option|choice)|answer|答案)"
    r"\s*(?:is\b|:|：|=|为|是)\s*[:：]?",
    re.IGNORECASE,
)


def _strip_thinking(text: str) -> str:
    return text.rsplit("</think>", 1)[1] if "</think>" in text else text


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


def _answer_segment(text: str) -> tuple[str, str]:
    """(segment, how): how is 'boxed', 'marker' or 'tail' (the whole text; read from its end)."""
    text = _strip_thinking(text)
    boxed = _last_boxed(text)
    if boxed is not None and boxed.strip():
        return boxed.strip(), "boxed"
    matches = list(_MARKER.finditer(text))
    if matches:
        rest = text[matches[-1].end():].strip()
        first_line = rest.split("\n", 1)[0].strip()
        if first_line:
            return first_line, "marker"
    return text.strip(), "tail"


# --------------------------------------------------------------------------- numbers

_NUM = r"[-−–]?\d+(?:,\d{3})*(?:\.\d+)?(?:[eE][-+]?\d+)?|[-−–]?\.\d+"
_NUM_RE = re.compile(rf"(?<![\w.])(?:{_NUM})(?![\d])")
_FRAC_RE = re.compile(rf"(?<![\w.])({_NUM})\s*/\s*({_NUM})(?![\d.])")
_WORDS = {w: i for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
    "fifteen sixteen seventeen eighteen nineteen twenty".split())}


def _delatex(s: str) -> str:
    s = re.sub(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}", r"\1/\2", s)
    s = re.sub(r"\\(?:text|mathrm|mathbf|textbf|operatorname)\s*\{([^{}]*)\}", r" \1 ", s)
    s = s.replace("\\%", "%").replace("\\,", "").replace("\\!", "").replace("\\ ", " ")
    s = s.replace("\\left", "").replace("\\right", "").replace("$", " ")
    s = re.sub(r"\^\s*\{?\\circ\}?|°|\\circ|\\degree", " ", s)
    return s


def _strip_units(s: str, unit: str | None) -> str:
    if unit:
        s = re.sub(re.escape(unit), " ", s, flags=re.IGNORECASE)
    # Unit exponents (cm^2, m²) would otherwise be read as the last number.
    s = re.sub(r"(?<=[A-Za-z])\s*\^\s*\{?-?\d+\}?", " ", s)
    s = re.sub(r"(?<=[A-Za-z])[²³]", " ", s)
    return s


def _to_decimal(token: str) -> Decimal | None:
    token = token.replace("−", "-").replace("–", "-").replace(",", "").replace(" ", "")
    try:
        return Decimal(token)
    except InvalidOperation:
        return None


def _numbers(s: str) -> list[Decimal]:
    """Numbers in reading order; a/b fractions become one number."""
    found: list[tuple[int, Decimal]] = []
    taken: list[tuple[int, int]] = []
    for m in _FRAC_RE.finditer(s):
        a, b = _to_decimal(m.group(1)), _to_decimal(m.group(2))
        if a is not None and b not in (None, Decimal(0)):
            found.append((m.start(), a / b))
            taken.append(m.span())
    for m in _NUM_RE.finditer(s):
        if any(lo <= m.start() < hi for lo, hi in taken):
            continue
        d = _to_decimal(m.group(0))
        if d is not None:
            found.append((m.start(), d))
    found.sort(key=lambda t: t[0])
    return [d for _, d in found]


def _pick_number(segment: str, how: str, unit: str | None) -> Decimal | None:
    s = _strip_units(_delatex(segment), unit)
    nums = _numbers(s)
    if nums:
        # After an explicit marker the first number is the answer ("12 cm, since 3*4=12");
        # without one, a model's final value is at the end.
        return nums[0] if how in ("boxed", "marker") else nums[-1]
    words = re.findall(r"[a-z]+", s.lower())
    hits = [_WORDS[w] for w in words if w in _WORDS]
    if hits:
        return Decimal(hits[0] if how in ("boxed", "marker") else hits[-1])
    return None


def _quantize(d: Decimal, places: int) -> Decimal:
    return d.quantize(Decimal(1).scaleb(-places), rounding=ROUND_HALF_UP)


def _places_of(answer: str) -> int:
    return len(answer.split(".", 1)[1]) if "." in answer else 0


# --------------------------------------------------------------------------- lists

def _parse_list(segment: str, how: str) -> list[Decimal] | None:
    s = _delatex(segment)
    brackets = re.findall(r"\[([^\[\]]*)\]", s)
    if brackets:
        inner = brackets[-1] if how == "tail" else brackets[0]
    elif how == "tail":
        lines = [ln for ln in s.splitlines() if ln.strip()]
        inner = lines[-1] if lines else ""
    else:
        inner = s
    items = [x for x in re.split(r"[,;]", inner) if x.strip()]
    out = []
    for x in items:
        nums = [_to_decimal(m.group(0)) for m in re.finditer(r"[-−–]?\d+(?:\.\d+)?|[-−–]?\.\d+", x)]
        if len(nums) != 1 or nums[0] is None:
            return None
        out.append(nums[0])
    return out or None


def _num_out(d: Decimal) -> int | float:
    return int(d) if d == d.to_integral_value() else float(d)


# --------------------------------------------------------------------------- multiple choice

def _norm_choice(s: str) -> str:
    s = _delatex(str(s)).lower()
    s = re.sub(r"\s+", " ", s).strip()
    # "6 cm" and "6cm" are the same choice
    s = re.sub(r"(?<=\d) (?=[a-z%])", "", s)
    return s.strip(" .。;:,")


_LETTER_ALONE = re.compile(r"^\(?([A-Z])\)?[.:)]?$")
_LETTER_LEAD = re.compile(r"^\(?([A-Z])(?:\)|\.|:|\s*$)")
_LETTER_PAREN = re.compile(r"\(([A-Z])\)")
_LETTER_WORD = re.compile(r"\b(?:option|choice)\s*\(?([A-Z])\)?(?![\w])", re.IGNORECASE)


def _choice_by_letter(segment: str, how: str, letters: str) -> str | None:
    seg = segment.strip().strip("*").strip()
    m = _LETTER_ALONE.match(seg)
    if m and m.group(1) in letters:
        return m.group(1)
    lines = [ln.strip().strip("*").strip() for ln in seg.splitlines() if ln.strip()]
    lead_target = seg if how != "tail" else (lines[-1] if lines else "")
    m = _LETTER_LEAD.match(lead_target)
    if m and m.group(1) in letters:
        return m.group(1)
    if how != "tail":
        # "Answer: B 140°" — a capital letter then a space; in free text this would catch the word "A".
        m = re.match(r"^([A-Z])\s", seg)
        if m and m.group(1) in letters:
            return m.group(1)
    for rx in (_LETTER_PAREN, _LETTER_WORD):
        found = [x for x in rx.findall(seg) if x.upper() in letters]
        if found:
            return (found[-1] if how == "tail" else found[0]).upper()
    return None


def _choice_by_text(segment: str, how: str, choices: list[str]) -> int | None:
    seg = _norm_choice(segment)
    norms = [_norm_choice(c) for c in choices]
    for i, c in enumerate(norms):
        if c and seg == c:
            return i
    best = None  # (position, length, index)
    for i, c in enumerate(norms):
        if not c:
            continue
        for m in re.finditer(rf"(?<![0-9a-z.]){re.escape(c)}(?![0-9a-z])", seg):
            pos = m.start() if how == "tail" else -m.start()
            cand = (pos, len(c), i)
            if best is None or cand[:2] > best[:2]:
                best = cand
    return best[2] if best else None


def _closest_choice(segment: str, how: str, choices: list[str]) -> int | None:
    target = segment.strip()
    if how == "tail":
        lines = [ln for ln in target.splitlines() if ln.strip()]
        target = lines[-1] if lines else ""
    target = _norm_choice(target)
    if not target:
        return None
    ratios = [difflib.SequenceMatcher(None, target, _norm_choice(c)).ratio() for c in choices]
    return max(range(len(choices)), key=lambda i: ratios[i])


# --------------------------------------------------------------------------- public MathVista API

def extract_mathvista_answer(prediction_text: str, meta: Mapping[str, Any]) -> tuple[Any, str]:
    """(extracted value, method) for one prediction, by the problem's question/answer type.

    multi_choice -> the choice text; integer -> int; float -> float rounded to
    `precision`; list -> list of numbers; None when nothing usable is found.
    """
    if not isinstance(prediction_text, str):
        raise TypeError(f"prediction_text must be a string, got {type(prediction_text).__name__}")
    qtype, atype = meta.get("question_type"), meta.get("answer_type")
    segment, how = _answer_segment(prediction_text)
    if not segment:
        return None, "empty"
    if qtype == "multi_choice":
        choices = [str(c) for c in (meta.get("choices") or [])]
        if not choices:
            raise ValueError("multi_choice problem without choices in meta")
        letters = _LETTERS[: len(choices)]
        letter = _choice_by_letter(segment, how, letters)
        if letter is not None:
            return choices[letters.index(letter)], f"{how}:letter"
        i = _choice_by_text(segment, how, choices)
        if i is not None:
            return choices[i], f"{how}:text"
        i = _closest_choice(segment, how, choices)
        return (choices[i], f"{how}:closest") if i is not None else (None, "none")
    if qtype != "free_form":
        raise ValueError(f"unknown MathVista question_type {qtype!r}")
    unit = meta.get("unit")
    if atype == "integer":
        d = _pick_number(segment, how, unit)
        if d is None:
            return None, "none"
        return (int(d) if d == d.to_integral_value() else float(d)), f"{how}:number"
    if atype == "float":
        d = _pick_number(segment, how, unit)
        if d is None:
            return None, "none"
        prec = meta.get("precision")
        places = int(prec) if prec is not None else _places_of(str(meta.get("answer") or ""))
        return float(_quantize(d, places)), f"{how}:number"
    if atype == "list":
        items = _parse_list(segment, how)
        return ([_num_out(x) for x in items], f"{how}:list") if items else (None, "none")
    raise ValueError(f"unknown MathVista answer_type {atype!r}")


def _reference(meta: Mapping[str, Any]):
    answer = meta.get("answer")
    if answer is None:
        raise ValueError("prompt meta has no reference 'answer'")
    answer = str(answer)
    qtype, atype = meta.get("question_type"), meta.get("answer_type")
    if qtype == "multi_choice":
        return answer
    if atype == "integer":
        d = _to_decimal(answer.strip())
        if d is None:
            raise ValueError(f"integer answer {answer!r} is not a number")
        return int(d) if d == d.to_integral_value() else float(d)
    if atype == "float":
        d = _to_decimal(answer.strip())
        if d is None:
            raise ValueError(f"float answer {answer!r} is not a number")
        prec = meta.get("precision")
        return float(_quantize(d, int(prec) if prec is not None else _places_of(answer)))
    if atype == "list":
        items = _parse_list(answer, "marker")
        if items is None:
            raise ValueError(f"list answer {answer!r} is not a list of numbers")
        return [_num_out(x) for x in items]
    raise ValueError(f"unknown MathVista answer_type {atype!r}")


def score_mathvista(prediction_text: str, prompt_meta: Mapping[str, Any]) -> dict:
    """{"extracted", "correct", "answer", "method"} for one MathVista prediction."""
    extracted, method = extract_mathvista_answer(prediction_text, prompt_meta)
    reference = _reference(prompt_meta)
    if prompt_meta.get("question_type") == "multi_choice":
        correct = extracted is not None and _norm_choice(extracted) == _norm_choice(reference)
    elif isinstance(reference, list):
        correct = isinstance(extracted, list) and len(extracted) == len(reference) and all(
            Decimal(str(a)) == Decimal(str(b)) for a, b in zip(extracted, reference))
    else:
        correct = extracted is not None and Decimal(str(extracted)) == Decimal(str(reference))
    return {"extracted": extracted, "correct": bool(correct), "answer": reference, "method": method}


# --------------------------------------------------------------------------- MM-Vet

class MMVetGraderMissing(RuntimeError):
    """MM-Vet scores were requested but no grader is registered."""


MMVetGrader = Callable[[str, str, str, Mapping[str, Any]], float]
_grader: MMVetGrader | None = None


def register_mmvet_grader(fn: MMVetGrader | None) -> None:
    """Install the MM-Vet grader: fn(question, reference_answer, prediction, meta) -> score in [0, 1].

    MM-Vet is graded by a language model comparing the prediction with the
    reference (which uses <AND>/<OR>); the workbench ships none. Pass None to remove it.
    """
    global _grader
    if fn is not None and not callable(fn):
        raise TypeError("the MM-Vet grader must be callable")
    _grader = fn


def get_mmvet_grader() -> MMVetGrader | None:
    return _grader


def grade_mmvet(question: str, prediction: str, meta: Mapping[str, Any]) -> float:
    if _grader is None:
        raise MMVetGraderMissing(
            "MM-Vet scores need a model grader and none is registered; call "
            "workbench.datasets.scoring.register_mmvet_grader(fn) with "
            "fn(question, reference_answer, prediction, meta) -> score in [0, 1]")
    score = _grader(question, str(meta.get("answer", "")), prediction, meta)
    try:
        value = float(score)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"MM-Vet grader returned a non-number: {score!r}") from exc
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"MM-Vet grader returned {value}, outside [0, 1]")
    return value


def mmvet_capability_table(records, prompts=None, values: Iterable[str] = (), scores: bool = False,
                           by: str = "capability"):
    """Per-capability summary of MM-Vet records (a DataFrame or an iterable of dicts).

    Each record counts once under each of its capabilities (`by="capability"`)
    or once under its capability combination (`by="combination"`). The table
    has `n` and the mean of each column in `values` (e.g. tok_s, acceptance_length);
    with `scores=True` also `score`, the mean grader score in [0, 1]; records
    without a `score` are graded with the registered grader, which must exist.
    Capabilities come from the record (`capability` or `meta`) or from `prompts`
    (Prompts or a pid -> Prompt mapping).
    """
    import pandas as pd

    df = records.copy() if isinstance(records, pd.DataFrame) else pd.DataFrame(list(records))
    if "pid" not in df.columns:
        raise ValueError("MM-Vet records need a 'pid' column")
    by_pid = None
    if prompts is not None:
        by_pid = prompts if isinstance(prompts, Mapping) else {p.pid: p for p in prompts}
    caps, questions, metas = [], [], []
    for _, row in df.iterrows():
        pid = str(row["pid"])
        meta = None
        if by_pid is not None:
            if pid not in by_pid:
                raise KeyError(f"record pid {pid!r} is not among the MM-Vet prompts given")
            meta = dict(by_pid[pid].meta)
            questions.append(by_pid[pid].text)
        else:
            meta = dict(row["meta"]) if "meta" in df.columns and isinstance(row["meta"], Mapping) else {}
            questions.append(row.get("question"))
        cap = row["capability"] if "capability" in df.columns else meta.get("capability")
        if cap is None or (isinstance(cap, float)) or len(cap) == 0:
            raise ValueError(f"record pid {pid!r}: no capability (give prompts= or a 'capability' column)")
        caps.append(list(cap))
        metas.append(meta)
    df["capability"] = caps
    values = list(values)
    for v in values:
        if v not in df.columns:
            raise KeyError(f"value column {v!r} not in records")
    if scores:
        if "score" not in df.columns:
            df["score"] = float("nan")
        todo = df["score"].isna()
        if todo.any():
            if "text" not in df.columns:
                raise ValueError("grading needs the prediction in a 'text' column")
            for idx in df.index[todo]:
                i = df.index.get_loc(idx)
                if not metas[i].get("answer"):
                    raise ValueError(f"record pid {df.at[idx, 'pid']!r}: no reference answer to grade against")
                df.at[idx, "score"] = grade_mmvet(str(questions[i] or ""), str(df.at[idx, "text"]), metas[i])
        values = values + ["score"]
    if by == "capability":
        long = df.explode("capability")
        key = "capability"
    elif by == "combination":
        long = df.assign(combination=[",".join(sorted(c)) for c in df["capability"]])
        key = "combination"
    else:
        raise ValueError(f"by must be 'capability' or 'combination', got {by!r}")
    agg = {"n": ("pid", "size")}
    for v in values:
        agg[v] = (v, "mean")
    table = long.groupby(key, sort=True).agg(**agg).reset_index()
    total = {key: "total", "n": len(df)}
    for v in values:
        total[v] = df[v].mean()
    return pd.concat([table, pd.DataFrame([total])], ignore_index=True)
