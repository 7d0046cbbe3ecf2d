"""Image traces are not tied to the traced images: other sizes / padding images replay exactly,
and the Idefics3 override computes what transformers' own code computes."""

from __future__ import annotations

import torch
from zoo_tiny_models import ARCHS

from layerwise.host.patch_selection import apply_patch
from layerwise.model_zoo import _inputs, idefics3, llava
from layerwise.tracing import trace


def _padded_idefics3_batch(config) -> dict[str, torch.Tensor]:
    """Row 0: two images; row 1: one image and one all-zero padding image."""
    run = [config.image_token_id] * idefics3.image_token_count(config)
    ids = _inputs.image_prompt(config.text_config.vocab_size, run + [7] + run, 2, avoid={config.image_token_id})
    ids[1, 4 + len(run):4 + 2 * len(run)] = 9
    pixel_values = _inputs.pixels(2, 2, 3, 56, 56)
    pixel_values[1, 1] = 0
    mask = torch.ones(2, 2, 56, 56, dtype=torch.bool)
    mask[1, 1] = False
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixel_values,
            "pixel_attention_mask": mask}


def test_idefics3_override_matches_transformers_and_replays_padding_images() -> None:
    plain = ARCHS["idefics3"].build()
    batch = _padded_idefics3_batch(plain.config)
    with torch.no_grad():
        want = plain(**batch).logits
    model = ARCHS["idefics3"].build()
    apply_patch(model, idefics3.IDEFICS3)
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).logits, want, rtol=0, atol=1e-6)
    sample = idefics3.sample_inputs(model.config, "image")  # one image per row, no padding
    result = trace(model, sample, idefics3.IDEFICS3.sequential_targets, idefics3.IDEFICS3.ignore)
    assert len(result.subgraphs) == 5
    assert result.verify(batch) <= 1e-5


def test_pixtral_trace_replays_other_image_sizes() -> None:
    model = ARCHS["pixtral"].build()
    apply_patch(model, llava.LLAVA)
    sample = llava.sample_inputs(model.config, "image")
    result = trace(model, sample, llava.LLAVA.sequential_targets, llava.LLAVA.ignore)
    assert len(result.subgraphs) == 5
    ids = sample["input_ids"].clone()
    image = (ids[1] == model.config.image_token_index).nonzero().flatten()
    ids[1, image[len(image) // 2:]] = 5  # the second image is half as tall: half the tokens
    other = dict(sample, input_ids=ids, image_sizes=torch.tensor([[56, 56], [28, 56]]))
    assert result.verify(other) <= 1e-5
