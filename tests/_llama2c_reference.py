"""llama2.c's run.c in plain torch, for checking the HuggingFace conversion against.

Written from run.c's semantics and independent of kbbq_pl.io.llama2c: its own file reader (pointer
walk of ``memory_map_weights``), a token-at-a-time ``forward`` with a KV cache and interleaved
RoPE pairs, and the tokenizer's ``encode`` (highest-score pair merges, byte fallback) and
``decode``.
"""

from __future__ import annotations

import struct
from pathlib import Path

import torch
from torch import Tensor


class Tokenizer:
    """run.c's ``Tokenizer``: ``build_tokenizer``, ``encode`` and ``decode``."""

    def __init__(self, path: Path, vocab_size: int) -> None:
        raw = path.read_bytes()
        offset = 4
        self.vocab: list[bytes] = []
        self.scores: list[float] = []
        for _ in range(vocab_size):
            score, length = struct.unpack_from("<fi", raw, offset)
            offset += 8
            self.vocab.append(raw[offset : offset + length])
            self.scores.append(score)
            offset += length
        self.lookup = {piece: i for i, piece in enumerate(self.vocab)}

    def encode(self, text: str, bos: bool = True) -> list[int]:
        tokens = [self.lookup[b" "]] if text else []
        for char in text:
            piece = char.encode("utf-8")
            if piece in self.lookup:
                tokens.append(self.lookup[piece])
            else:
                tokens.extend(byte + 3 for byte in piece)
        while True:
            best_score, best_id, best_idx = -1e10, -1, -1
            for i in range(len(tokens) - 1):
                merged = self.lookup.get(self.vocab[tokens[i]] + self.vocab[tokens[i + 1]])
                if merged is not None and self.scores[merged] > best_score:
                    best_score, best_id, best_idx = self.scores[merged], merged, i
            if best_idx == -1:
                break
            tokens[best_idx : best_idx + 2] = [best_id]
        return ([1] if bos else []) + tokens

    def decode(self, tokens: list[int]) -> str:
        out = b""
        for prev, token in zip([None, *tokens], tokens):
            if token in (0, 1, 2):
                continue
            piece = self.vocab[token]
            if prev == 1 and piece.startswith(b" "):
                piece = piece[1:]
            if piece.startswith(b"<0x") and len(piece) == 6:
                piece = bytes([int(piece[3:5], 16)])
            out += piece
        return out.decode("utf-8", errors="replace")


class Llama2c:
    def __init__(self, checkpoint: Path, tokenizer: Path) -> None:
        data = checkpoint.read_bytes()
        (self.dim, self.hidden_dim, self.n_layers, self.n_heads, self.n_kv_heads, vocab,
         self.seq_len) = struct.unpack_from("<7i", data)
        self.vocab_size = abs(vocab)
        self.head_size = self.dim // self.n_heads
        floats = torch.frombuffer(bytearray(data[28:]), dtype=torch.float32)
        self._ptr = 0

        def take(*shape: int) -> Tensor:
            count = 1
            for size in shape:
                count *= size
            out = floats[self._ptr : self._ptr + count].reshape(shape)
            self._ptr += count
            return out

        L, d, h, hs = self.n_layers, self.dim, self.hidden_dim, self.head_size
        kv_dim = self.n_kv_heads * hs
        self.token_embedding_table = take(self.vocab_size, d)
        self.rms_att_weight = take(L, d)
        self.wq = take(L, d, d)
        self.wk = take(L, kv_dim, d)
        self.wv = take(L, kv_dim, d)
        self.wo = take(L, d, d)
        self.rms_ffn_weight = take(L, d)
        self.w1 = take(L, h, d)
        self.w2 = take(L, d, h)
        self.w3 = take(L, h, d)
        self.rms_final_weight = take(d)
        take(self.seq_len * hs // 2)  # freq_cis_real
        take(self.seq_len * hs // 2)  # freq_cis_imag
        self.wcls = self.token_embedding_table if vocab > 0 else take(self.vocab_size, d)
        assert self._ptr == floats.numel()

        self.tokenizer = Tokenizer(tokenizer, self.vocab_size)
        self.encode = self.tokenizer.encode
        self.decode = self.tokenizer.decode

    @staticmethod
    def rmsnorm(x: Tensor, weight: Tensor) -> Tensor:
        return weight * (x / torch.sqrt((x * x).mean() + 1e-5))

    def new_cache(self, length: int) -> tuple[Tensor, Tensor]:
        kv_dim = self.n_kv_heads * self.head_size
        return (torch.zeros(self.n_layers, length, kv_dim),
                torch.zeros(self.n_layers, length, kv_dim))

    def step(self, token: int, pos: int, cache: tuple[Tensor, Tensor]) -> Tensor:
        """run.c's ``forward(transformer, token, pos)``: logits of the next token."""
        key_cache, value_cache = cache
        hs, kv_mul = self.head_size, self.n_heads // self.n_kv_heads
        kv_dim = self.n_kv_heads * hs
        x = self.token_embedding_table[token].clone()
        for layer in range(self.n_layers):
            xb = self.rmsnorm(x, self.rms_att_weight[layer])
            q = self.wq[layer] @ xb
            k = self.wk[layer] @ xb
            v = self.wv[layer] @ xb
            for i in range(0, self.dim, 2):
                freq = 1.0 / 10000.0 ** ((i % hs) / hs)
                angle = torch.tensor(pos * freq)
                fcr, fci = torch.cos(angle), torch.sin(angle)
                for vec in ((q, k) if i < kv_dim else (q,)):
                    v0, v1 = vec[i].clone(), vec[i + 1].clone()
                    vec[i] = v0 * fcr - v1 * fci
                    vec[i + 1] = v0 * fci + v1 * fcr
            key_cache[layer, pos] = k
            value_cache[layer, pos] = v
            xb = torch.zeros(self.dim)
            for head in range(self.n_heads):
                qh = q[head * hs : (head + 1) * hs]
                kv = (head // kv_mul) * hs
                keys = key_cache[layer, : pos + 1, kv : kv + hs]
                att = torch.softmax(keys @ qh / hs**0.5, dim=0)
                xb[head * hs : (head + 1) * hs] = att @ value_cache[layer, : pos + 1, kv : kv + hs]
            x = x + self.wo[layer] @ xb
            xb = self.rmsnorm(x, self.rms_ffn_weight[layer])
            hb = torch.nn.functional.silu(self.w1[layer] @ xb) * (self.w3[layer] @ xb)
            x = x + self.w2[layer] @ hb
        return self.wcls @ self.rmsnorm(x, self.rms_final_weight)

    def forward(self, tokens: list[int]) -> Tensor:
        """Logits ``[len(tokens), vocab]``, one position at a time."""
        cache = self.new_cache(len(tokens))
        return torch.stack([self.step(t, pos, cache) for pos, t in enumerate(tokens)])

    def generate(self, steps: int) -> list[int]:
        """Greedy decoding from BOS (token 1) for ``steps`` tokens, stopping at BOS or EOS
        (run.c's generate loop stops at BOS)."""
        tokens = [1]
        cache = self.new_cache(steps + 1)
        for pos in range(steps):
            nxt = int(self.step(tokens[-1], pos, cache).argmax())
            if nxt in (1, 2):
                break
            tokens.append(nxt)
        return tokens
