"""Convert a llama2.c checkpoint and tokenizer into a HuggingFace Llama model folder.

llama2.c (github.com/karpathy/llama2.c) stores a model as a "v0" (legacy) checkpoint: a header
of 7 int32 (``dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len``; a negative
``vocab_size`` means the classifier is not shared with the token embedding) followed by float32
weights in ``run.c`` order, and its tokenizer as ``int32 max_token_length`` then, per token,
``float32 score, int32 length, bytes``.

:func:`convert_llama2c` writes a folder that ``AutoModelForCausalLM`` and ``AutoTokenizer`` load
offline: ``config.json`` and ``model.safetensors`` of a ``LlamaForCausalLM`` and a
``tokenizer.json`` (a ``tokenizers`` BPE over the llama2.c pieces, merges ranked by score, byte
fallback, a dummy space prefix: llama2.c's sentencepiece-style encoder).  BOS is id 1, EOS id 2, UNK
id 0.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .fileio import check_output, save_safetensors, write_folder

__all__ = [
    "Llama2cConfig",
    "read_llama2c_checkpoint",
    "read_llama2c_tokenizer",
    "interleaved_to_halves",
    "hf_llama_config",
    "hf_state_dict",
    "build_tokenizer",
    "convert_llama2c",
]

HEADER = struct.Struct("<7i")
VERSIONED_MAGIC = 0x616B3432  # "ak42": llama2.c's export format version >= 1
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
SPACE = "\u2581"  # sentencepiece's visible space
_BYTE_PIECE = re.compile(r"^<0x[0-9A-F]{2}>$")


@dataclass(frozen=True)
class Llama2cConfig:
    """The llama2.c v0 header; ``shared_classifier`` is ``vocab_size > 0`` in the file."""

    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    seq_len: int
    shared_classifier: bool

    @property
    def head_size(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_size

    def weight_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """The float32 arrays after the header, in ``run.c``'s ``memory_map_weights`` order;
        ``freq_cis_*`` (unused precomputed RoPE tables) are skipped when reading."""
        d, h, n, v = self.dim, self.hidden_dim, self.n_layers, self.vocab_size
        q = self.n_heads * self.head_size
        shapes = [
            ("token_embedding", (v, d)),
            ("rms_att", (n, d)),
            ("wq", (n, q, d)),
            ("wk", (n, self.kv_dim, d)),
            ("wv", (n, self.kv_dim, d)),
            ("wo", (n, d, q)),
            ("rms_ffn", (n, d)),
            ("w1", (n, h, d)),
            ("w2", (n, d, h)),
            ("w3", (n, h, d)),
            ("rms_final", (d,)),
            ("freq_cis_real", (self.seq_len, self.head_size // 2)),
            ("freq_cis_imag", (self.seq_len, self.head_size // 2)),
        ]
        if not self.shared_classifier:
            shapes.append(("wcls", (v, d)))
        return shapes

    def file_size(self) -> int:
        """Bytes of a complete checkpoint with this header."""
        floats = sum(_numel(shape) for _, shape in self.weight_shapes())
        return HEADER.size + 4 * floats


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def parse_header(data: bytes, path: str | Path = "<bytes>") -> Llama2cConfig:
    """The :class:`Llama2cConfig` of a v0 checkpoint's first 28 bytes, checked for sense."""
    if len(data) < HEADER.size:
        raise ValueError(f"{path}: {len(data)} bytes, shorter than the {HEADER.size}-byte "
                         "llama2.c header")
    if struct.unpack_from("<I", data)[0] == VERSIONED_MAGIC:
        version = struct.unpack_from("<i", data, 4)[0]
        raise ValueError(f"{path}: a llama2.c export of format version {version} (magic 'ak42'); "
                         "only the legacy v0 format (header of 7 int32, float32 weights) is read")
    dim, hidden, layers, heads, kv_heads, vocab, seq_len = HEADER.unpack_from(data)
    values = dict(dim=dim, hidden_dim=hidden, n_layers=layers, n_heads=heads,
                  n_kv_heads=kv_heads, vocab_size=vocab, seq_len=seq_len)
    problems = [f"{k}={v}" for k, v in values.items() if k != "vocab_size" and not 0 < v < 2**20]
    if vocab == 0 or abs(vocab) >= 2**24:
        problems.append(f"vocab_size={vocab}")
    if not problems and (dim % heads or heads % kv_heads or (dim // heads) % 2):
        problems.append(f"dim {dim} / n_heads {heads} / n_kv_heads {kv_heads} do not divide "
                        "into even heads")
    if problems:
        raise ValueError(f"{path}: not a llama2.c v0 checkpoint, its header has "
                         f"{', '.join(problems)} (header read as {values})")
    return Llama2cConfig(dim, hidden, layers, heads, kv_heads, abs(vocab), seq_len,
                         shared_classifier=vocab > 0)


def read_llama2c_checkpoint(path: str | Path) -> tuple[Llama2cConfig, dict[str, Tensor]]:
    """The header and the weights of a v0 checkpoint, in llama2.c's own layout (``[layer, out,
    in]`` matrices, interleaved RoPE pairs), float32; ``freq_cis`` tables dropped."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"llama2.c checkpoint {str(path)!r} does not exist")
    data = file.read_bytes()
    config = parse_header(data, file)
    expected = config.file_size()
    if len(data) != expected:
        what = "truncated" if len(data) < expected else "longer than its header says"
        raise ValueError(f"{file}: {what}: {len(data)} bytes, but the header {config} needs "
                         f"exactly {expected}")
    floats = torch.frombuffer(bytearray(data[HEADER.size:]), dtype=torch.float32)
    weights: dict[str, Tensor] = {}
    offset = 0
    for name, shape in config.weight_shapes():
        count = _numel(shape)
        if not name.startswith("freq_cis"):
            weights[name] = floats[offset : offset + count].reshape(shape).clone()
        offset += count
    return config, weights


def read_llama2c_tokenizer(path: str | Path, vocab_size: int) -> list[tuple[bytes, float]]:
    """The ``vocab_size`` (piece bytes, score) pairs of a llama2.c ``tokenizer.bin``."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"llama2.c tokenizer {str(path)!r} does not exist")
    data = file.read_bytes()
    if len(data) < 4:
        raise ValueError(f"{file}: {len(data)} bytes, too short for a llama2.c tokenizer")
    max_length = struct.unpack_from("<i", data)[0]
    if not 0 < max_length < 2**16:
        raise ValueError(f"{file}: not a llama2.c tokenizer (max_token_length={max_length})")
    offset = 4
    pieces: list[tuple[bytes, float]] = []
    for index in range(vocab_size):
        if offset + 8 > len(data):
            raise ValueError(f"{file}: truncated at token {index} of {vocab_size} "
                             f"({len(data)} bytes)")
        score, length = struct.unpack_from("<fi", data, offset)
        offset += 8
        if not 0 <= length <= max_length or offset + length > len(data):
            raise ValueError(f"{file}: token {index} has length {length} (max_token_length "
                             f"{max_length}, {len(data) - offset} bytes left): truncated or "
                             "not a llama2.c tokenizer")
        pieces.append((data[offset : offset + length], score))
        offset += length
    if offset != len(data):
        raise ValueError(f"{file}: {len(data) - offset} bytes after the {vocab_size} tokens the "
                         "checkpoint's vocab_size asks for: tokenizer and checkpoint differ")
    return pieces


def interleaved_to_halves(weight: Tensor, n_heads: int) -> Tensor:
    """Rows of a q/k projection reordered from llama2.c's RoPE layout to HF Llama's.

    llama2.c rotates the pairs ``(x[2i], x[2i+1])`` of each head with frequency ``i``; HF's
    ``rotate_half`` pairs ``(x[i], x[i + head_size/2])``.  Row ``2i + p`` of a head moves to
    ``i + p * head_size/2``, so every pair keeps its frequency; q.k per head is unchanged.
    """
    rows, columns = weight.shape
    head_size = rows // n_heads
    return (weight.reshape(n_heads, head_size // 2, 2, columns).transpose(1, 2)
            .reshape(rows, columns))


def hf_llama_config(config: Llama2cConfig) -> Any:
    """The ``LlamaConfig`` of the same architecture (RMSNorm eps 1e-5, RoPE base 10000)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.dim,
        intermediate_size=config.hidden_dim,
        num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads,
        num_key_value_heads=config.n_kv_heads,
        head_dim=config.head_size,
        max_position_embeddings=config.seq_len,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        hidden_act="silu",
        tie_word_embeddings=config.shared_classifier,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        architectures=["LlamaForCausalLM"],
        dtype="float32",
    )


def hf_state_dict(config: Llama2cConfig, weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """``LlamaForCausalLM`` parameters from :func:`read_llama2c_checkpoint`'s weights (no
    ``lm_head.weight`` when the classifier is shared: HF ties it to the embedding)."""
    state = {"model.embed_tokens.weight": weights["token_embedding"],
             "model.norm.weight": weights["rms_final"]}
    for layer in range(config.n_layers):
        prefix = f"model.layers.{layer}."
        state.update({
            prefix + "input_layernorm.weight": weights["rms_att"][layer],
            prefix + "self_attn.q_proj.weight":
                interleaved_to_halves(weights["wq"][layer], config.n_heads),
            prefix + "self_attn.k_proj.weight":
                interleaved_to_halves(weights["wk"][layer], config.n_kv_heads),
            prefix + "self_attn.v_proj.weight": weights["wv"][layer],
            prefix + "self_attn.o_proj.weight": weights["wo"][layer],
            prefix + "post_attention_layernorm.weight": weights["rms_ffn"][layer],
            prefix + "mlp.gate_proj.weight": weights["w1"][layer],
            prefix + "mlp.down_proj.weight": weights["w2"][layer],
            prefix + "mlp.up_proj.weight": weights["w3"][layer],
        })
    if not config.shared_classifier:
        state["lm_head.weight"] = weights["wcls"]
    return {name: tensor.contiguous() for name, tensor in state.items()}


def _hf_pieces(pieces: list[tuple[bytes, float]], path: str | Path) -> list[str]:
    """Token strings in sentencepiece spelling: specials named, spaces as U+2581."""
    names = []
    for index, (raw, _) in enumerate(pieces):
        if index in (UNK_ID, BOS_ID, EOS_ID):
            names.append(("<unk>", "<s>", "</s>")[index])
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{path}: token {index} ({raw!r}) is not UTF-8") from None
        names.append(text if _BYTE_PIECE.match(text) else text.replace(" ", SPACE))
    seen: dict[str, int] = {}
    for index, name in enumerate(names):
        if name in seen:
            raise ValueError(f"{path}: tokens {seen[name]} and {index} are both {name!r}")
        seen[name] = index
    return names


def bpe_merges(names: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Every pair of ordinary pieces whose concatenation is a piece, best-scoring result first:
    a BPE that applies them by rank merges like llama2.c's encoder (highest score first)."""
    ordinary = {name: i for i, name in enumerate(names)
                if i not in (UNK_ID, BOS_ID, EOS_ID) and not _BYTE_PIECE.match(name)}
    ranked = []
    for name, index in ordinary.items():
        for cut in range(1, len(name)):
            left, right = name[:cut], name[cut:]
            if left in ordinary and right in ordinary:
                ranked.append((-scores[index], index, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def build_tokenizer(
    pieces: list[tuple[bytes, float]], model_max_length: int, path: str | Path = "<tokenizer>"
) -> Any:
    """A ``PreTrainedTokenizerFast`` that encodes and decodes like llama2.c's tokenizer.

    Encoding: a space in front of the text (sentencepiece's dummy prefix), spaces spelled
    U+2581, then BPE with the merges of :func:`bpe_merges`; characters outside the vocabulary
    become their UTF-8 byte tokens ``<0xXX>``.  ``<s>`` (id 1) starts every encoded sequence.

    llama2.c has no pad token; ``<unk>`` (id 0) is declared as one, so that batches can be
    padded (the positions are masked out).  Not ``</s>``: a collator that masks the pad id out
    of the labels would then never train the end of a sequence.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors
    from transformers import PreTrainedTokenizerFast

    names = _hf_pieces(pieces, path)
    scores = [score for _, score in pieces]
    vocab = {name: index for index, name in enumerate(names)}
    model = models.BPE(vocab=vocab, merges=bpe_merges(names, scores), unk_token="<unk>",
                       byte_fallback=True, fuse_unk=True)
    tokenizer = Tokenizer(model)
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)]
    )
    tokenizer.decoder = decoders.Sequence([
        decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
        decoders.Strip(" ", 1, 0),
    ])
    tokenizer.add_special_tokens([AddedToken(names[i], special=True, normalized=False)
                                  for i in (UNK_ID, BOS_ID, EOS_ID)])
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        pad_token="<unk>",
        model_max_length=model_max_length, clean_up_tokenization_spaces=False,
    )


def _portable_tokenizer_class(path: Path) -> None:
    """Name the tokenizer class that transformers 4 and 5 both load from tokenizer.json."""
    settings = json.loads(path.read_text(encoding="utf-8"))
    settings["tokenizer_class"] = "PreTrainedTokenizerFast"
    settings.pop("backend", None)
    path.write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def convert_llama2c(
    checkpoint_path: str | Path,
    tokenizer_path: str | Path,
    out_dir: str | Path,
    *,
    overwrite: bool = False,
) -> Path:
    """Write a HuggingFace ``LlamaForCausalLM`` folder (config, safetensors, tokenizer,
    generation config) converted from a llama2.c v0 checkpoint and its tokenizer.

    The folder is built beside ``out_dir`` and renamed into place, so a failure leaves no partial
    folder.  The sources are only read.  An existing ``out_dir`` is an error unless
    ``overwrite``, and even then only a folder kbbq-pl wrote is replaced
    (:func:`kbbq_pl.io.fileio.check_output`).  Returns the folder.
    """
    from transformers import GenerationConfig

    sources = [checkpoint_path, tokenizer_path]
    out = check_output(out_dir, overwrite=overwrite, sources=sources)
    config, weights = read_llama2c_checkpoint(checkpoint_path)
    pieces = read_llama2c_tokenizer(tokenizer_path, config.vocab_size)
    tokenizer = build_tokenizer(pieces, config.seq_len, tokenizer_path)
    hf_config = hf_llama_config(config)
    state = hf_state_dict(config, weights)

    def write(folder: Path) -> None:
        hf_config.save_pretrained(folder)
        GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID,
                         pad_token_id=UNK_ID).save_pretrained(folder)
        save_safetensors(state, folder / "model.safetensors", metadata={"format": "pt"})
        tokenizer.save_pretrained(folder)
        _portable_tokenizer_class(folder / "tokenizer_config.json")

    return write_folder(out, write, kind="llama2c", overwrite=overwrite, sources=sources,
                        metadata={"checkpoint": str(Path(checkpoint_path).resolve()),
                                  "tokenizer": str(Path(tokenizer_path).resolve())})
