"""Teacher-forced logits with transformers: an independent judge of a leg.

For a prompt and the token ids a leg emitted, one forward pass of a model
(transformers' own implementation, not vLLM) gives the logits that predicted
each emitted token. This is the workbench's one teacher-forcing path: the E7
score leg (``workbench.score``) uses a draft's to measure its top-1 agreement
with the target's output; the tiny-model checks (``workbench.testing``) use it
for twin quality; the relaxed-tier tests use the target's to check every
emitted token stays within the gate; exactness tests use them to tell a
near-tie from a real error.
"""

from __future__ import annotations

import torch

from .chat import load_images, render_prompt
from .prompts import Prompt

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def top1_agreement(logits: torch.Tensor, gen_ids: list[int]) -> list[bool]:
    """Row i of teacher-forced ``logits`` against ``gen_ids[i]``: does the argmax pick it?"""
    return (logits.argmax(dim=-1) == torch.tensor(gen_ids)).tolist()


class TeacherForcer:
    def __init__(self, model_dir: str, dtype: str = "auto", device: str | None = None):
        from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor,
                                  AutoTokenizer)

        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if dtype == "auto":
            dtype = "bfloat16" if self.device == "cuda" else "float32"
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {dtype!r}")
        self.model_dir, self.dtype = model_dir, dtype
        config = AutoConfig.from_pretrained(model_dir)
        self.is_vl = hasattr(config, "vision_config")
        cls = AutoModelForImageTextToText if self.is_vl else AutoModelForCausalLM
        self.model = cls.from_pretrained(model_dir, dtype=_DTYPES[dtype]).to(self.device).eval()
        # A text-only checkpoint has no image processor to load.
        self.processor = (AutoProcessor if self.is_vl else AutoTokenizer).from_pretrained(model_dir)
        self.tokenizer = getattr(self.processor, "tokenizer", self.processor)

    def _encode(self, prompt: Prompt, blank: bool = False) -> dict:
        # A text-only model (e.g. a text draft) reads the prompt without its images.
        text = render_prompt(self.tokenizer, prompt, with_images=self.is_vl)
        images = load_images(prompt, blank=blank) if self.is_vl else []
        if images:
            return self.processor(text=[text], images=images, return_tensors="pt")
        return self.tokenizer([text], return_tensors="pt")

    def prompt_len(self, prompt: Prompt) -> int:
        return int(self._encode(prompt)["input_ids"].shape[1])

    @torch.no_grad()
    def forward(self, prompt: Prompt, gen_ids: list[int], blank: bool = False) -> tuple[torch.Tensor, int]:
        """(float32 [len(gen_ids), vocab] logits, prompt length); row i predicted gen_ids[i].

        ``blank``: with every picture of the prompt replaced by a white one of the same size."""
        enc = self._encode(prompt, blank=blank)
        prompt_len = enc["input_ids"].shape[1]
        n = len(gen_ids)
        for key, value in list(enc.items()):
            # Every per-token tensor (ids, mask, modality type ids) grows by the
            # generated tokens, which are text.
            if isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape == (1, prompt_len):
                if key == "input_ids":
                    tail = torch.tensor([gen_ids], dtype=value.dtype)
                elif key == "attention_mask":
                    tail = torch.ones((1, n), dtype=value.dtype)
                else:
                    tail = torch.zeros((1, n), dtype=value.dtype)
                enc[key] = torch.cat([value, tail], dim=1)
        enc = {k: (v.to(self.device) if isinstance(v, torch.Tensor) else v) for k, v in enc.items()}
        out = self.model(**enc)
        return out.logits[0, prompt_len - 1 : prompt_len - 1 + n].float().cpu(), prompt_len

    def logits(self, prompt: Prompt, gen_ids: list[int]) -> torch.Tensor:
        return self.forward(prompt, gen_ids)[0]

    def agreement(self, prompt: Prompt, gen_ids: list[int]) -> list[bool]:
        """Per emitted token: is it this model's top-1 given the prompt and the tokens before it?"""
        return top1_agreement(self.logits(prompt, gen_ids), gen_ids) if gen_ids else []

    def image_grounded(self, prompt: Prompt, gen_ids: list[int]) -> list[bool]:
        """Per emitted token: does this model's greedy choice there change when the pictures are blank?

        Teacher-forced on ``gen_ids`` with blank pictures, one pass: position i is image-grounded when the
        argmax there differs from ``gen_ids[i]`` (the greedy choice a vanilla or strict leg emitted). A
        prompt without pictures has no image-grounded token."""
        if not gen_ids or not prompt.images or not self.is_vl:
            return [False] * len(gen_ids)
        blank = self.forward(prompt, gen_ids, blank=True)[0]
        return (blank.argmax(dim=-1) != torch.tensor(gen_ids)).tolist()

    @torch.no_grad()
    def greedy(self, prompt: Prompt, max_new_tokens: int, min_new_tokens: int = 0) -> list[int]:
        """This model's own greedy continuation of the prompt (transformers' ``generate``)."""
        enc = {k: (v.to(self.device) if isinstance(v, torch.Tensor) else v) for k, v in self._encode(prompt).items()}
        out = self.model.generate(**enc, max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens,
                                  do_sample=False)
        return out[0, enc["input_ids"].shape[1]:].tolist()

    def margins(self, prompt: Prompt, gen_ids: list[int]) -> torch.Tensor:
        """max logit - logit of the emitted token, per emitted token (0 = argmax)."""
        lg = self.logits(prompt, gen_ids)
        emitted = lg.gather(1, torch.tensor(gen_ids).unsqueeze(1)).squeeze(1)
        return lg.max(dim=1).values - emitted

    def top2_gap(self, prompt: Prompt, prefix_ids: list[int]) -> float:
        """Gap between the model's two best logits after prompt + prefix_ids."""
        lg = self.logits(prompt, list(prefix_ids) + [0])[-1]
        top = torch.topk(lg, 2).values
        return float(top[0] - top[1])
