"""The tiny multimodal model the scheduler's multimodal shape runs (``Shape.mm_item_tokens``).

vLLM's scheduler gives a model an encoder budget only when the model takes images: it builds the
model's multimodal processor (``MultiModalBudget``, 0.33.0 vllm/multimodal/encoder_budget.py:45-130;
0.12.0 ``compute_encoder_budget``, v1/core/encoder_cache_manager.py) to learn the most encoder
tokens one image can take, and sizes the encoder compute budget and the encoder cache from that
and the token budget (``compute_mm_encoder_budget``, encoder_cache_manager.py:333-378).  The
text-only tiny Llama of adapters/v1_scheduler.py has none (its scheduler's budget is 0).

This module writes a BLIP-2 folder kvspec owns, read offline like the tiny Llama (no weights,
nothing downloaded): ``config.json`` (an OPT language model, a one-layer vision tower and
Q-Former of toy sizes, ``num_query_tokens`` = the shape's tokens per image: BLIP-2's image is
that many placeholder tokens, model_executor/models/blip2.py:434-436 in 0.33.0), a word-level
tokenizer holding ``<image>`` (the processor's image token, blip2.py:481-486), and the image
processor's and processor's configs that transformers' ``Blip2Processor`` loads.  The scheduler
still reads only kvspec's own KV-cache groups (adapters/v1_scheduler.py ``_specs``).

BLIP-2 because it imports on every V1 release kvspec provisions (0.12.0-0.33.0); its processor
on transformers 5.x (vLLM 0.25.1+) imports ``pycountry``, which the lean venvs therefore keep
(targets/lean.py).  A release that cannot build it refuses the shape (``ConfigError`` with the
reason), and ``kvspec check`` says so (``multimodal_refusal``).
"""

from __future__ import annotations

import importlib
import json

# The BLIP-2 parts, at toy sizes: the scheduler reads the config, never the weights.
VISION_CONFIG = {
    "model_type": "blip_2_vision_model",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 1,
    "image_size": 16,
    "patch_size": 8,
}
QFORMER_CONFIG = {
    "model_type": "blip_2_qformer",
    "hidden_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 1,
    "intermediate_size": 64,
    "encoder_hidden_size": VISION_CONFIG["hidden_size"],
    "vocab_size": 128,
}
IMAGE_TOKEN = "<image>"
# The tokenizer's words: unknown, begin and end of sequence, the image token, a few plain words.
MM_VOCAB = ("<unk>", "<s>", "</s>", IMAGE_TOKEN, "a", "b", "c", "d")


def blip2_config(tokens_per_image: int, text: dict) -> dict:
    """A BLIP-2 ``config.json`` whose images are ``tokens_per_image`` tokens, over the language
    model ``text`` (the tiny Llama's sizes, as OPT)."""
    return {
        "architectures": ["Blip2ForConditionalGeneration"],
        "model_type": "blip-2",
        "num_query_tokens": tokens_per_image,
        "image_token_index": MM_VOCAB.index(IMAGE_TOKEN),
        "text_config": {
            "model_type": "opt",
            "architectures": ["OPTForCausalLM"],
            "vocab_size": text["vocab_size"],
            "hidden_size": text["hidden_size"],
            "word_embed_proj_dim": text["hidden_size"],
            "ffn_dim": text["intermediate_size"],
            "num_hidden_layers": text["num_hidden_layers"],
            "num_attention_heads": text["num_attention_heads"],
            "max_position_embeddings": text["max_position_embeddings"],
            "torch_dtype": text["torch_dtype"],
        },
        "vision_config": VISION_CONFIG,
        "qformer_config": QFORMER_CONFIG,
        "torch_dtype": text["torch_dtype"],
    }


def blip2_files(tokens_per_image: int, text: dict) -> dict[str, str]:
    """The folder's files by name.  The tokenizer config names no ``image_token``: transformers
    4.x's ``Blip2Processor`` then adds ``<image>`` itself (already in the vocabulary, so its id
    stays), where one named as a string breaks its ``.content`` (transformers 5.7-5.17)."""
    tokenizers = importlib.import_module("tokenizers")
    vocab = {word: i for i, word in enumerate(MM_VOCAB)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token=MM_VOCAB[0]))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    side = VISION_CONFIG["image_size"]
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": MM_VOCAB[0],
        "bos_token": MM_VOCAB[1],
        "eos_token": MM_VOCAB[2],
        "model_max_length": text["max_position_embeddings"],
    }
    image_processor = {
        "image_processor_type": "BlipImageProcessor",
        "processor_class": "Blip2Processor",
        "size": {"height": side, "width": side},
        "do_resize": True,
        "do_rescale": True,
        "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
    }
    processor = {"processor_class": "Blip2Processor", "num_query_tokens": tokens_per_image}
    return {
        "config.json": json.dumps(blip2_config(tokens_per_image, text), indent=1),
        "tokenizer.json": tok.to_str(),
        "tokenizer_config.json": json.dumps(tokenizer_config, indent=1),
        "preprocessor_config.json": json.dumps(image_processor, indent=1),
        "processor_config.json": json.dumps(processor, indent=1),
    }


def root_cause(error: BaseException) -> BaseException:
    """The innermost exception of a chain (vLLM wraps a processor's failure in a ValueError)."""
    while error.__cause__ is not None or error.__context__ is not None:
        error = error.__cause__ or error.__context__  # type: ignore[assignment]
    return error


__all__ = ["IMAGE_TOKEN", "MM_VOCAB", "blip2_config", "blip2_files", "root_cause"]
