"""Images in: fetching and decoding (fetch.py), the image processor of Qwen3-VL / Qwen3.5
(processor.py) and the prompt they make, placeholders expanded and M-RoPE positions (prompt.py)."""
from blockspec.multimodal.fetch import ImageError, MediaPolicy, load_image
from blockspec.multimodal.processor import ImageInput, ImageProcessorConfig, process_image
from blockspec.multimodal.prompt import MultimodalPrompt, expand_prompt

__all__ = ["ImageError", "ImageInput", "ImageProcessorConfig", "MediaPolicy", "MultimodalPrompt", "expand_prompt",
           "load_image", "process_image"]
