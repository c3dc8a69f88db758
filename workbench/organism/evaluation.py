"""The organism's evaluation: greedy answers to rows' prompts, scored as the corpus scores them.

`evaluate` answers every row's prompt by greedy generation (optionally with every picture replaced by a
blank one of the same size, which a model that looks answers near chance) and scores each answer with
`workbench.organism.corpus.score_output`: the accuracy, the outputs and the accuracy of each template.
Training (`workbench.organism.train`) picks its best checkpoint with it; the drafters' distillation
(`workbench.organism.models`) takes the organism's own answers from it.
"""

from __future__ import annotations

from workbench.organism import corpus as C
from workbench.organism.rows import Example, _images


def evaluate(model, processor, examples: list[Example], variant: str, max_new_tokens: int, batch: int = 32,
             blank: bool = False) -> dict:
    """Greedy answers to the examples' prompts, scored by `corpus.score_output`: accuracy and outputs."""
    import torch

    from workbench.chat import render_prompt

    tok = processor.tokenizer
    eos = [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]
    outputs: list[str] = []
    scores: list[float] = []
    was_training = model.training
    model.eval()
    try:
        for i in range(0, len(examples), batch):
            chunk = examples[i:i + batch]
            tok.padding_side = "left"
            enc = processor(text=[render_prompt(tok, ex.prompt) for ex in chunk], images=_images(chunk, blank),
                            padding=True, return_tensors="pt")
            with torch.no_grad():
                gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
                                     pad_token_id=tok.pad_token_id)
            for ex, row in zip(chunk, gen[:, enc["input_ids"].shape[1]:]):
                text = tok.decode(row, skip_special_tokens=True)
                outputs.append(text)
                scores.append(C.score_output(text, ex.prompt.meta, style=variant)["score"])
    finally:
        tok.padding_side = "right"
        model.train(was_training)
    per: dict[str, list[float]] = {}
    for ex, sc in zip(examples, scores):
        per.setdefault(ex.prompt.meta["template"], []).append(sc)
    return {"accuracy": sum(scores) / max(1, len(scores)), "n": len(scores), "outputs": outputs,
            "per_template": {t: sum(v) / len(v) for t, v in sorted(per.items())}}
