"""The tiny vision-language model's processor: Qwen3-VL's image and text handling, without video.

transformers' Qwen3VLProcessor always builds a video processor, and its video processors
need torchvision, which has no wheel for the CPU-only torch these machines use. Images
are handled by the PIL-backed Qwen2-VL image processor (the one Qwen3-VL uses), and
<|image_pad|> expands to one token per merged patch exactly as in Qwen3VLProcessor, so the
model sees the inputs a full Qwen3-VL pipeline would give it.

Importing this module registers the class with AutoProcessor, so `AutoProcessor.from_pretrained`
(and lm-eval's `hf-multimodal` or `specmoe-vlm`) loads a saved tiny VL model's processor.
"""
from __future__ import annotations

from transformers import AutoProcessor, PretrainedConfig, ProcessorMixin
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

from evalsuite.zoo.configs import VL_CONTEXT
from evalsuite.zoo.tokenizer import build_tokenizer

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


class ImageTextProcessor(Qwen3VLProcessor):
    """Qwen3VLProcessor with an image processor and a tokenizer only (no video)."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)
        for name, token in zip(("vision_start", "vision_end", "image", "video"), VISION_TOKENS):
            setattr(self, f"{name}_token", token)
            setattr(self, f"{name}_token_id", tokenizer.convert_tokens_to_ids(token))


class _RegistryKey(PretrainedConfig):
    """AutoProcessor finds registered processors by class name, but registers them under a config class."""
    model_type = "evalsuite_image_text"


AutoProcessor.register(_RegistryKey, ImageTextProcessor, exist_ok=True)


def build_processor(image_side: int) -> ImageTextProcessor:
    """Character tokenizer plus the four vision tokens; images resized to image_side x image_side."""
    tokenizer = build_tokenizer()
    tokenizer.model_max_length = VL_CONTEXT
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    pixels = image_side * image_side
    images = Qwen2VLImageProcessorPil(patch_size=8, temporal_patch_size=2, merge_size=2,
                                      size={"shortest_edge": pixels, "longest_edge": pixels})
    return ImageTextProcessor(image_processor=images, tokenizer=tokenizer)
