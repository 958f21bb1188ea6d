"""Test configuration: offline, deterministic, eager kernels unless a test asks for compiled."""

import contextlib
import os
import sys
from collections.abc import Iterator

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Compiling a kernel costs seconds; the suite runs eager kernels and tests/formats/test_formats.py
# checks the compiled ones against them bit for bit.
os.environ.setdefault("KBBQ_PL_COMPILE", "0")
# Under pytest-xdist (the README's ``-n 2``) each worker takes its share of the cores, so that
# the workers' threads (and their subprocesses') do not outnumber them.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
THREADS = max(1, (_CORES or 1) // _WORKERS)
"""torch's threads in this process: its share of the cores."""
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

# Without a GPU the Triton kernels of kbbq_pl.kernels run under Triton's interpreter, which
# must be chosen before triton.jit decorates them (kbbq_pl.kernels imports them lazily).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _patch_the_language_once_a_launch() -> None:
    """Triton's interpreter (3.6 to 3.9) patches ``triton.language`` for the interpreter when a
    launch begins (``GridExecutor.__call__``, undone when it ends) and again on every call of
    a ``@triton.jit`` helper inside it (``InterpretedFunction.__call__``): a scan of the
    language's modules, about 1 ms a call, that inside a launch changes nothing (the builtins
    are wrapped already, the other attributes set to the same functions) and whose undo record
    it drops.  The kernels call their helpers in every loop step of every program, so that
    scan was about 30% of the interpreted kernel tests' time.  Here a helper's call inside a
    launch skips it when the launch has patched the language modules the helper sees; anything
    else (a launch, a helper seeing other modules, a Triton without these names) runs as
    Triton does."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    patch_lang = getattr(interpreter, "_patch_lang", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    executor = getattr(interpreter, "GridExecutor", None)
    if patch_lang is None or scope_type is None or executor is None:
        return
    launch = executor.__call__
    patched: list[set[int]] = []  # per running launch, the language modules patched

    def launch_patching_once(self, *args, **kwargs):
        patched.append(set())
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.pop()

    def patch_lang_once(fn):
        langs = {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}
        if patched and langs <= patched[-1]:
            return scope_type()  # nothing to undo
        if patched:
            patched[-1] |= langs
        return patch_lang(fn)

    executor.__call__ = launch_patching_once
    interpreter._patch_lang = patch_lang_once


_patch_the_language_once_a_launch()

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"

# The tests mirror the package (tests/formats/, tests/quant/, ...) with no __init__.py files, so
# every test module is imported by its basename (all unique).  Helper modules (tests/*.py) and
# test modules that others import from (tests/formats/test_formats.py, ...) are found the same
# way whichever file pytest is asked to run.
TESTS = Path(__file__).resolve().parent
for _folder in [TESTS, *sorted(p for p in TESTS.iterdir() if p.is_dir() and p.name[0] not in "._"
                                 and p.name != "data")]:
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))


def pytest_collection_modifyitems(config, items):
    run_slow = os.environ.get("KBBQ_PL_SLOW") == "1"
    has_cuda = torch.cuda.is_available()
    for item in items:
        if "slow" in item.keywords and not run_slow:
            item.add_marker(pytest.mark.skip(reason="slow test: set KBBQ_PL_SLOW=1 to run it"))
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """torch's intra-op threads set to ``count``, and restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def one_thread():
    """Small tensors: starting threads costs more than the work, badly so on a shared machine
    (``pytestmark = pytest.mark.usefixtures("one_thread")`` in a module)."""
    with torch_threads(1):
        yield


@pytest.fixture
def worker_threads():
    """A heavy test's torch threads: this process's share of the cores (all of them without
    pytest-xdist), whatever an earlier test left set."""
    with torch_threads(THREADS):
        yield


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data folder {SHARED_DATA} is absent")
    return SHARED_DATA


@pytest.fixture
def poison_input():
    """``poison_input(module, column, value)``: every call of ``module`` sees ``value`` (NaN or
    Inf) in feature ``column`` of its input, put there by a forward pre-hook, so the value
    reaches the layer under test whatever a CPU's vector kernels do with infinities upstream."""
    handles = []

    def poison(module: torch.nn.Module, column: int, value: float) -> None:
        def hook(module, args):
            x = args[0].clone()
            x[..., column] = value
            return (x, *args[1:])

        handles.append(module.register_forward_pre_hook(hook))

    yield poison
    for handle in handles:
        handle.remove()


@pytest.fixture(scope="session")
def tiny_llama2c_folder(tmp_path_factory) -> Path:
    """The real tiny llama2.c model of the shared data (aidreams260K) as a HF folder with its
    512-token tokenizer; skipped when the shared data are absent."""
    from kbbq_pl.io.llama2c import convert_llama2c

    tiny = SHARED_DATA / "tiny_llama_aidreams260K"
    if not (tiny / "aidreams260K.bin").is_file():
        pytest.skip(f"the tiny llama2.c model is absent ({tiny})")
    return convert_llama2c(tiny / "aidreams260K.bin", tiny / "tok512.bin",
                           tmp_path_factory.mktemp("model") / "tiny")


CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
"""A plain chat template for the tiny chat model's tokenizer."""


@pytest.fixture(scope="session")
def tiny_chat_folder(tmp_path_factory) -> Path:
    """A tiny Llama chat model made without any data file, so that loading, generating and
    serving are tested everywhere: four blocks of hidden size 64 (an FFN of 172, not a multiple
    of the FP4 blocks: its down_proj is padded), random weights (seeded), and a
    512-token byte-level BPE tokenizer trained on the package's calibration corpus, with
    :data:`CHAT_TEMPLATE`; saved as a HF folder (float32 safetensors)."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from kbbq_pl.resources import calibration_corpus

    texts = [json.loads(line)["text"] for line in
             calibration_corpus().read_text(encoding="utf-8").splitlines() if line.strip()]
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        pad_token="<unk>", model_max_length=256, clean_up_tokenization_spaces=False)
    tokenizer.chat_template = CHAT_TEMPLATE
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=172,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0, tie_word_embeddings=True)
    folder = tmp_path_factory.mktemp("chat") / "tiny-chat"
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_chat_quantized(tiny_chat_folder, tmp_path_factory) -> Path:
    """The tiny chat model quantized by the default recipe (RTN-KBBQ NVFP4, lambda 0.75,
    static activation scales) on 256 tokens of the shipped corpus and saved by
    ``save_quantized`` with its tokenizer."""
    from kbbq_pl import QuantizationConfig, quantize_model, save_quantized
    from kbbq_pl.io.data import CalibrationDataModule
    from kbbq_pl.io.models import load_model

    model, tokenizer = load_model(tiny_chat_folder)
    batches = CalibrationDataModule("mixed", tokenizer, n_tokens=256,
                                    seq_len=64).calibration_dataloader()
    quantize_model(model, list(batches), QuantizationConfig(), progress=False)
    return save_quantized(model, tmp_path_factory.mktemp("tiny-q") / "q", tokenizer=tokenizer,
                          recipe=QuantizationConfig().to_dict())


@pytest.fixture(scope="session")
def _smollm2_cache(tmp_path_factory) -> Path:
    """A kbbq-pl cache holding SmolLM2-135M-Instruct converted from its GGUF file once a
    run (about 25 s on two cores): under pytest-xdist the workers share it, the first to ask
    converting it while the others wait on a lock."""
    from filelock import FileLock

    from kbbq_pl.io.models import resolve_model_path

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # this run's folder, above each worker's own
    cache = root / "kbbq_pl_cache_smollm2"
    with FileLock(f"{cache}.lock"), pytest.MonkeyPatch.context() as patch:
        patch.setenv("KBBQ_PL_CACHE", str(cache))
        resolve_model_path("smollm2")  # converts only what the cache lacks
    return cache


@pytest.fixture
def smollm2_cache(_smollm2_cache, monkeypatch) -> Path:
    """``$KBBQ_PL_CACHE`` set to the session's converted SmolLM2 for this test: loading
    ``"smollm2"`` converts nothing again and leaves the user's cache alone."""
    monkeypatch.setenv("KBBQ_PL_CACHE", str(_smollm2_cache))
    return _smollm2_cache


def pytest_runtest_logreport(report):
    """With ``KBBQ_PL_FAILURE_LOG=PATH``, each failure's traceback is appended to PATH as it
    happens (a GPU session stopped at its time limit keeps what failed and why)."""
    path = os.environ.get("KBBQ_PL_FAILURE_LOG")
    if path and report.failed:
        with open(path, "a", encoding="utf-8") as log:
            log.write(f"\n===== {report.nodeid} ({report.when}, {report.duration:.1f} s)\n"
                      f"{report.longreprtext}\n")
