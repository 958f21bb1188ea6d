"""The inputs of the bench scripts' ``--tiny`` modes: random-initialized models small enough to
quantize in a second, saved with a byte-level tokenizer; the WikiText-2 excerpt kbbq-pl ships;
two questions each for the benchmarks a script reads.

Nothing here downloads or reads ``../shared/data``: a tiny run checks that a script still runs
against the package, not what it measures.  Not a bench script itself (no table, no ``--tiny``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Literal

TINY_LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=320,
                  max_position_embeddings=512)
"""A Llama whose every linear holds whole NVFP4 (16) and MXFP4 (32) blocks."""
TINY_BERT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, vocab_size=320, max_position_embeddings=512)
"""A BERT encoder of the same size, standing in for all-MiniLM-L6-v2."""
SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>"}
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant:{% endif %}")


def byte_tokenizer():
    """A tokenizer with one token per byte (256), ``<pad>``, ``<s>`` and ``</s>``, and a chat
    template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **SPECIAL_TOKENS)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_tiny_model(folder: str | Path, kind: Literal["llama", "bert"] = "llama",
                    seed: int = 0) -> Path:
    """A random-initialized ``llama`` (causal LM) or ``bert`` (encoder) with
    :func:`byte_tokenizer`, saved in ``folder`` as a HuggingFace checkpoint; returns
    ``folder``."""
    import torch
    from transformers import BertConfig, BertModel, LlamaConfig, LlamaForCausalLM

    tokenizer = byte_tokenizer()
    torch.manual_seed(seed)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(
            **TINY_LLAMA, pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id))
    elif kind == "bert":
        model = BertModel(BertConfig(**TINY_BERT, pad_token_id=tokenizer.pad_token_id))
    else:
        raise ValueError(f"unknown tiny model kind {kind!r}: llama or bert")
    folder = Path(folder)
    model.eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def wikitext_file() -> Path:
    """The head of WikiText-2 ``test.txt`` that kbbq-pl ships (24 KB, the tokenized form that
    :func:`kbbq_pl.eval.evaluation.wikitext_sentences` reads)."""
    from kbbq_pl.resources import eval_text

    return eval_text()


def eager() -> None:
    """Run the rounding kernels eagerly in this process and the processes it starts: compiling
    them takes longer than a whole tiny run."""
    os.environ["KBBQ_PL_COMPILE"] = "0"
    dispatch = sys.modules.get("kbbq_pl.formats.dispatch")
    if dispatch is not None:  # imported already: it read the variable then
        dispatch.set_compile("0")


ARC_EASY = [
    {"query": "Question: Which gas do plants take in to make their food?",
     "choices": ["carbon dioxide", "helium", "neon", "argon"], "gold": 0},
    {"query": "Question: What does a thermometer measure?",
     "choices": ["mass", "temperature", "length", "volume"], "gold": 1},
]


def save_arc_easy(data_dir: str | Path) -> Path:
    """``data_dir`` laid out like ``../shared/data`` for the ``arc_easy`` task (two questions in
    llm-foundry's form, :mod:`kbbq_pl.eval.tasks`); returns ``data_dir``."""
    path = Path(data_dir) / "llm_foundry_eval" / "arc_easy.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(doc) + "\n" for doc in ARC_EASY), encoding="utf-8")
    return Path(data_dir)


GSM8K = [{"question": "Tom has 3 apples and buys 2 more. How many apples does he have?",
          "answer": "3 + 2 = 5\n#### 5"},
         {"question": "A box holds 4 pens. How many pens do 3 boxes hold?",
          "answer": "4 * 3 = 12\n#### 12"}]


def save_gsm8k(path: str | Path) -> Path:
    """Two GSM8K-style questions as ``test.jsonl`` lines at ``path``; returns ``path``."""
    path = Path(path)
    path.write_text("".join(json.dumps(doc) + "\n" for doc in GSM8K), encoding="utf-8")
    return path
