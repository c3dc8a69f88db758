"""Teacher-forced target logits with transformers: an independent judge of a leg.

For a prompt and the token ids a leg emitted, one forward pass of the target
(transformers' own Qwen3-VL, not vLLM) gives the logits that predicted each
emitted token. Used to check that relaxed-tier outputs stay within the gate,
and to classify a divergence as a near-tie or a real error.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .chat import load_images, render_prompt
from .prompts import Prompt

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class TeacherForcer:
    model_dir: str
    dtype: str = "float32"

    def __post_init__(self):
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor

        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        config = AutoConfig.from_pretrained(self.model_dir)
        self.is_vl = hasattr(config, "vision_config")
        cls = AutoModelForImageTextToText if self.is_vl else AutoModelForCausalLM
        self.model = cls.from_pretrained(self.model_dir, dtype=_DTYPES[self.dtype]).eval()
        self.processor = AutoProcessor.from_pretrained(self.model_dir)
        self.tokenizer = getattr(self.processor, "tokenizer", self.processor)

    @torch.no_grad()
    def logits(self, prompt: Prompt, gen_ids: list[int]) -> torch.Tensor:
        """float32 [len(gen_ids), vocab]: row i is the target's logits before gen_ids[i]."""
        text = render_prompt(self.tokenizer, prompt)
        images = load_images(prompt)
        if images:
            enc = self.processor(text=[text], images=images, return_tensors="pt")
        else:
            enc = self.tokenizer([text], return_tensors="pt")
        prompt_len = enc["input_ids"].shape[1]
        n = len(gen_ids)
        for key, value in list(enc.items()):
            # Every per-token tensor (ids, mask, modality type ids) grows by the
            # generated tokens, which are text.
            if isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape == (1, prompt_len):
                tail = torch.tensor([gen_ids], dtype=value.dtype) if key == "input_ids" else (
                    torch.ones((1, n), dtype=value.dtype) if key == "attention_mask"
                    else torch.zeros((1, n), dtype=value.dtype))
                enc[key] = torch.cat([value, tail], dim=1)
        out = self.model(**enc)
        return out.logits[0, prompt_len - 1 : prompt_len - 1 + len(gen_ids)].float()

    def margins(self, prompt: Prompt, gen_ids: list[int]) -> torch.Tensor:
        """max logit - logit of the emitted token, per emitted token (0 = argmax)."""
        lg = self.logits(prompt, gen_ids)
        emitted = lg.gather(1, torch.tensor(gen_ids).unsqueeze(1)).squeeze(1)
        return lg.max(dim=1).values - emitted

    def top2_gap(self, prompt: Prompt, prefix_ids: list[int]) -> float:
        """Gap between the target's two best logits after prompt + prefix_ids."""
        lg = self.logits(prompt, list(prefix_ids) + [0])[-1]
        top = torch.topk(lg, 2).values
        return float(top[0] - top[1])
