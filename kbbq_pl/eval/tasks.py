"""The paper's five benchmarks (and four more zero-shot likelihood tasks) through
lm-evaluation-harness, offline, on local data files.

:func:`run_benchmarks` evaluates an in-memory HuggingFace causal LM on

==========  =======  =========================================  =========================
task        shots    data (under ``data_dir``)                  score
==========  =======  =========================================  =========================
mmlu        5        ``mmlu/test/<subject>_test.csv``           acc (micro-average)
gsm8k       8, CoT   ``gsm8k/test.jsonl``, shots ``train.jsonl``  exact_match (strict)
hellaswag   0        ``hellaswag/hellaswag_val_full.txt.bz2``   acc_norm
winogrande  5        ``winogrande/winogrande_dev_llmfoundry.jsonl``  acc
mbpp        3        ``mbpp/mbpp.jsonl``                        pass@1 (runs code, opt-in)
arc_easy    0        ``llm_foundry_eval/arc_easy.jsonl``        acc_norm
arc_chall.  0        ``llm_foundry_eval/arc_challenge.jsonl``   acc_norm
piqa        0        ``llm_foundry_eval/piqa.jsonl``            acc_norm
lambada     0        ``llm_foundry_eval/lambada_openai.jsonl``  acc (greedy last word)
==========  =======  =========================================  =========================

Where the local data differ from the hub data sets lm-eval normally reads:

* **MMLU** has only its test split here (no dev split): the 5 shots of a question are the first
  five rows of the *same subject's test file* other than the question itself (lm-eval's
  ``first_n`` sampler on the test split, which drops the evaluated row), so the shots are
  fixed per subject, as with the dev split.  The prompt is lm-eval's ``mmlu`` one.  ``limit``
  applies per subject (57 lm-eval tasks); the MMLU score is the accuracy over all evaluated
  questions.
* **GSM8K** chain of thought: the 8 shots are the first 8 rows of ``train.jsonl``, their
  reference solutions turned into a rationale (calculator annotations ``<<...>>`` removed,
  lines joined) ending in ``The answer is N.``; the prompt and answer extraction are lm-eval's
  ``gsm8k_cot`` ones (``strict-match``: the number after "The answer is"; ``flexible-extract``:
  the last number).
* **HellaSwag** is the full validation set as text: the context line is ``activity_label:
  context`` as stored (lm-eval would capitalize the second context sentence, which the text
  form no longer separates).
* **WinoGrande** has only its dev (xl validation) set here, in partial-evaluation form: each
  option's context is scored on the shared continuation, as lm-eval's ``winogrande`` does; the
  5 shots are drawn (seeded) from the *other rows of the same dev file*, leaving out the
  item's twin (same contexts, other continuation).
* **MBPP** uses the standard splits of the 974-task file: tasks 11-510 are the test set, and
  the 3 shots are tasks 2, 3 and 4 (the original paper's prompt examples, as lm-eval).  pass@1
  runs the generated code with the task's asserts in a separate Python process (timeout,
  memory and CPU limits, but **no sandbox**): it only runs with ``allow_code_execution=True``
  or the environment variable ``HF_ALLOW_CODE_EVAL=1``.

* **ARC-Easy / ARC-Challenge / PIQA / LAMBADA** are llm-foundry's in-context-learning files
  (``query`` already starting with ``Question:``, ``choices``, ``gold``; LAMBADA's ``context``
  and ``continuation``).  The prompts are lm-eval's ``arc_easy`` / ``piqa`` ones (``Question:
  ...\nAnswer:``, each choice scored as `` choice``; acc and length-normalized acc_norm) and
  ``lambada_openai``'s (the passage, then `` last-word``: acc is whether greedy decoding gives
  the whole last word, with its perplexity).  ARC and PIQA use the splits llm-foundry ships
  (ARC test, PIQA validation).

Sources that are not JSON lines (MMLU CSVs, the HellaSwag bz2 text) are converted at run time
into ``cache_dir`` (default ``$KBBQ_PL_CACHE/eval_data`` or ``~/.cache/kbbq_pl/eval_data``),
named by the source's content hash, written atomically; the ``datasets`` library keeps its
Arrow cache of every task's data under ``cache_dir/datasets``.
"""

from __future__ import annotations

import bz2
import csv
import json
import logging
import math
import os
import re
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..io.fileio import atomic_write_text, sha256_file

log = logging.getLogger(__name__)

BENCHMARKS: tuple[str, ...] = ("mmlu", "gsm8k", "hellaswag", "winogrande", "mbpp",
                                "arc_easy", "arc_challenge", "piqa", "lambada")
DEFAULT_FEWSHOT: dict[str, int] = {"mmlu": 5, "gsm8k": 8, "hellaswag": 0, "winogrande": 5,
                                   "mbpp": 3, "arc_easy": 0, "arc_challenge": 0, "piqa": 0,
                                   "lambada": 0}
PRIMARY_METRIC: dict[str, str] = {"mmlu": "acc", "gsm8k": "exact_match,strict-match",
                                  "hellaswag": "acc_norm", "winogrande": "acc",
                                  "mbpp": "pass_at_1", "arc_easy": "acc_norm",
                                  "arc_challenge": "acc_norm", "piqa": "acc_norm",
                                  "lambada": "acc"}
FOUNDRY_FILES: dict[str, str] = {"arc_easy": "arc_easy.jsonl",
                                 "arc_challenge": "arc_challenge.jsonl", "piqa": "piqa.jsonl",
                                 "lambada": "lambada_openai.jsonl"}
DATA_FILES: dict[str, tuple[str, ...]] = {
    "mmlu": ("mmlu/test/<subject>_test.csv",),
    "gsm8k": ("gsm8k/train.jsonl", "gsm8k/test.jsonl"),
    "hellaswag": ("hellaswag/hellaswag_val_full.txt.bz2",),
    "winogrande": ("winogrande/winogrande_dev_llmfoundry.jsonl",),
    "mbpp": ("mbpp/mbpp.jsonl",),
    **{task: (f"llm_foundry_eval/{name}",) for task, name in FOUNDRY_FILES.items()},
}
"""The files each benchmark reads, relative to ``data_dir`` (MMLU: one per subject);
:func:`check_data` checks them."""
DATA_NAMES: dict[str, str] = {"mmlu": "MMLU", "gsm8k": "GSM8K", "hellaswag": "HellaSwag",
                              "winogrande": "WinoGrande", "mbpp": "MBPP", "lambada": "LAMBADA"}
CODE_EVAL_ENV = "HF_ALLOW_CODE_EVAL"
MBPP_TEST_IDS = range(11, 511)
MBPP_SHOT_IDS = (2, 3, 4)


# ---------------------------------------------------------------------------------------------
# Local data: reading and converting
# ---------------------------------------------------------------------------------------------

def default_cache_dir() -> Path:
    root = os.environ.get("KBBQ_PL_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "kbbq_pl") / "eval_data"


_LAYOUT = "laid out like ../shared/data, see kbbq_pl.eval.tasks"


def mmlu_subjects(data_dir: str | Path, option: str = "data_dir") -> list[str]:
    """The subjects with a ``mmlu/test/<subject>_test.csv`` file, sorted."""
    folder = Path(data_dir) / "mmlu" / "test"
    if not folder.is_dir():
        raise FileNotFoundError(f"MMLU: {folder} is not a folder of <subject>_test.csv files; "
                                f"pass {option} FOLDER holding mmlu/test/ ({_LAYOUT})")
    subjects = sorted(p.name[: -len("_test.csv")] for p in folder.glob("*_test.csv"))
    if not subjects:
        raise FileNotFoundError(f"MMLU: no <subject>_test.csv files in {folder}; "
                                f"pass {option} FOLDER holding mmlu/test/ ({_LAYOUT})")
    return subjects


def data_file(data_dir: Path, task: str, index: int = 0) -> Path:
    """The ``index``-th file of :data:`DATA_FILES` of ``task`` under ``data_dir``."""
    return data_dir / DATA_FILES[task][index]


def check_data(
    tasks: Sequence[str], data_dir: str | Path, subjects: Sequence[str] | None = None,
    *, option: str = "data_dir",
) -> Path:
    """Check that ``data_dir`` holds every file the benchmarks ``tasks`` read
    (:data:`DATA_FILES`), before anything is loaded: the one check of the benchmark data
    (``kbbq-pl eval``/``compare`` run it before loading the model and importing lm-eval,
    :func:`task_configs` before building the tasks).  Raises ValueError for an unknown task,
    FileNotFoundError naming ``option`` (the argument the caller set ``data_dir`` with, e.g.
    ``--data-dir``) and the file expected; ``subjects``: the MMLU subjects (default: all the
    folder has).  Returns ``data_dir`` as a Path."""
    unknown = [t for t in tasks if t not in BENCHMARKS]
    if unknown:
        raise ValueError(
            f"unknown benchmark(s) {unknown}; choose from {list(BENCHMARKS)} (these read local "
            "files); lm-eval's other tasks run through its own command on a kbbq-pl folder: "
            "lm_eval --model hf --model_args pretrained=FOLDER,trust_remote_code=True "
            f"--tasks {','.join(unknown)}")
    data = Path(data_dir)
    if tasks and not data.is_dir():
        expected = ", ".join(DATA_FILES[t][0] for t in tasks)
        raise FileNotFoundError(
            f"{option} {data} is not a folder; the benchmark(s) {', '.join(tasks)} read "
            f"{expected} from it: pass {option} FOLDER ({_LAYOUT})")
    for task in tasks:
        if task == "mmlu":
            known = mmlu_subjects(data, option)
            unknown = [s for s in subjects or () if s not in known]
            if unknown and known:
                raise ValueError(f"MMLU subject(s) {unknown} (--mmlu-subjects) are not among "
                                 f"the {len(known)} of {data / 'mmlu' / 'test'}, e.g. "
                                 f"{known[:3]}")
            paths = [data / "mmlu" / "test" / f"{s}_test.csv" for s in subjects or known]
        else:
            paths = [data_file(data, task, i) for i in range(len(DATA_FILES[task]))]
        for path in paths:
            if not path.is_file():
                raise FileNotFoundError(
                    f"{DATA_NAMES.get(task, task)}: {path} does not exist; pass {option} FOLDER "
                    f"holding {path.relative_to(data).as_posix()} ({_LAYOUT})")
    return data


def read_mmlu_csv(path: str | Path) -> list[dict[str, Any]]:
    """Rows ``{"question", "choices": [4], "answer": 0-3}`` of an MMLU CSV that starts with the
    header ``Question,A,B,C,D,Answer``."""
    file = Path(path)
    with file.open(encoding="utf-8", newline="") as handle:
        rows = list(csv.reader(handle))
    header = ["Question", "A", "B", "C", "D", "Answer"]
    if not rows or rows[0] != header:
        raise ValueError(f"{file}: first row must be the header {','.join(header)}, got "
                         f"{rows[0] if rows else 'an empty file'}")
    docs = []
    for number, row in enumerate(rows[1:], 2):
        if len(row) != 6 or row[5].strip() not in ("A", "B", "C", "D"):
            raise ValueError(f"{file}:{number}: expected 6 fields ending in an answer letter "
                             f"A-D, got {row!r}")
        docs.append({"question": row[0], "choices": row[1:5],
                     "answer": "ABCD".index(row[5].strip())})
    if not docs:
        raise ValueError(f"{file}: no questions after the header")
    return docs


def read_hellaswag_text(path: str | Path) -> list[dict[str, Any]]:
    """Items ``{"query", "choices": [4], "label"}`` of the 6-lines-per-item HellaSwag text
    (``activity_label: context``, gold index, 4 endings), bz2-compressed or plain."""
    file = Path(path)
    opener = bz2.open if file.suffix == ".bz2" else open
    with opener(file, "rt", encoding="utf-8") as handle:
        lines = handle.read().split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if not lines or len(lines) % 6:
        raise ValueError(f"{file}: {len(lines)} lines, not a multiple of 6 (context, gold, "
                         "4 endings per item)")
    docs = []
    for start in range(0, len(lines), 6):
        context, gold, *endings = lines[start : start + 6]
        if gold.strip() not in ("0", "1", "2", "3"):
            raise ValueError(f"{file}:{start + 2}: gold index must be 0-3, got {gold!r}")
        docs.append({"query": _clean(context), "choices": [_clean(e) for e in endings],
                     "label": int(gold)})
    return docs


def _clean(text: str) -> str:
    return re.sub(r"  +", " ", text.strip())


def _write_jsonl(docs: Iterable[Mapping[str, Any]], target: Path) -> None:
    lines = "".join(json.dumps(doc, ensure_ascii=False, sort_keys=True) + "\n" for doc in docs)
    atomic_write_text(target, lines)


def converted_jsonl(source: Path, reader: Any, cache_dir: Path, name: str) -> Path:
    """``source`` read by ``reader`` and cached as JSON lines, named by its content hash."""
    target = cache_dir / f"{name}-{sha256_file(source)[:16]}.jsonl"
    if not target.is_file():
        _write_jsonl(reader(source), target)
    return target


# ---------------------------------------------------------------------------------------------
# Document functions used by the task configs
# ---------------------------------------------------------------------------------------------

def gsm8k_final_answer(doc: Mapping[str, Any]) -> str:
    """The number after ``####`` in a GSM8K solution."""
    return doc["answer"].split("####")[-1].strip()


def gsm8k_rationale(doc: Mapping[str, Any]) -> str:
    """A GSM8K reference solution as a one-paragraph chain of thought ending in
    ``The answer is N.`` (calculator annotations removed)."""
    steps = doc["answer"].split("####")[0]
    steps = re.sub(r"<<[^>]*>>", "", steps)
    lines = [line.strip() for line in steps.splitlines() if line.strip()]
    sentences = [line if line[-1] in ".!?" else line + "." for line in lines]
    return " ".join([*sentences, f"The answer is {gsm8k_final_answer(doc)}."])


def winogrande_gold(doc: Mapping[str, Any]) -> int:
    return int(doc["gold"])


def winogrande_options(doc: Mapping[str, Any]) -> list[str]:
    return list(doc["context_options"])


def _winogrande_sampler() -> type:
    """lm-eval's seeded random sampler, minus the evaluated item's twin (the row with the same
    two contexts and the other continuation), whose answer would give the item away."""
    from lm_eval.api.samplers import ContextSampler

    class OtherItemsSampler(ContextSampler):
        def sample(self, n: int, eval_doc: Any = None, df: Any = None, **kwargs: Any) -> Any:
            pool = self.fewshot_docs()
            if eval_doc is not None:
                pool = [d for d in pool if d["context_options"] != eval_doc["context_options"]]
            return self.rnd.sample(pool, n)

    return OtherItemsSampler


def _keep_task_ids(ids: Iterable[int]) -> Any:
    wanted = set(ids)

    def process(dataset: Any) -> Any:
        return dataset.filter(lambda doc: doc["task_id"] in wanted)

    return process


def _mbpp_tests(doc: Mapping[str, Any]) -> str:
    return "\n".join(doc["test_list"])


def _mbpp_shot_target(doc: Mapping[str, Any]) -> str:
    return _lf(doc["code"]) + "\n[DONE]"


def _mbpp_prompt(doc: Mapping[str, Any]) -> str:
    tests = "\n".join(doc["test_list"][:3])
    return (f"You are an expert Python programmer, and here is your task: {doc['text']} "
            f"Your code should pass these tests:\n\n{tests}\n[BEGIN]\n")


def _lf(text: str) -> str:
    return text.replace("\r\n", "\n")


# Runs in the child: caps memory (2 GiB) and CPU time, then executes the program from stdin.
_RUNNER = """
import sys
try:
    import resource
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
    resource.setrlimit(resource.RLIMIT_CPU, ({cpu}, {cpu}))
except (ImportError, ValueError, OSError):
    pass
source = sys.stdin.read()
exec(compile(source, "<generated>", "exec"), {{"__name__": "__main__"}})
"""


def run_python_tests(program: str, timeout: float = 10.0) -> bool:
    """Whether ``program`` exits cleanly in a fresh isolated Python process (in an empty
    temporary folder, memory and CPU capped, killed after ``timeout`` s; no sandbox)."""
    runner = _RUNNER.format(cpu=max(1, math.ceil(timeout)))
    with tempfile.TemporaryDirectory(prefix="kbbq_pl_mbpp_") as folder:
        try:
            done = subprocess.run(
                [sys.executable, "-I", "-c", runner], input=program.encode("utf-8"),
                cwd=folder, capture_output=True, timeout=timeout,
                env={"PATH": os.environ.get("PATH", "")},
            )
        except subprocess.TimeoutExpired:
            return False
    return done.returncode == 0


def mbpp_pass_at_1(doc: Mapping[str, Any], results: Sequence[str]) -> dict[str, float]:
    """1.0 when the first generation passes the task's setup code and asserts."""
    completion = _lf(results[0]).split("[DONE]")[0]
    program = "\n".join([_lf(doc.get("test_setup_code") or ""), completion,
                         *doc["test_list"]])
    return {"pass_at_1": float(run_python_tests(program))}


# ---------------------------------------------------------------------------------------------
# Task configs
# ---------------------------------------------------------------------------------------------

_ACC = [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]
_ACC_AND_NORM = [*_ACC, {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}]


def _json_dataset(files: Mapping[str, Path], cache_dir: Path) -> dict[str, Any]:
    return {"dataset_path": "json",
            "dataset_kwargs": {"data_files": {split: str(p) for split, p in files.items()},
                               "cache_dir": str(cache_dir / "datasets")}}


def _task_config(task: str, files: Mapping[str, Path], cache_dir: Path, num_fewshot: int,
                 fewshot_split: str = "test", **fields: Any) -> dict[str, Any]:
    """An lm-eval task over local JSON files (``files``: split -> path), scored on ``test``;
    ``fields``: the task's own keys (output type, prompts, metrics, ...)."""
    return {"task": task, **_json_dataset(files, cache_dir), "test_split": "test",
            "fewshot_split": fewshot_split, **fields, "num_fewshot": num_fewshot,
            "metadata": {"version": 1.0}}


def mmlu_configs(data_dir: Path, cache_dir: Path, num_fewshot: int,
                 subjects: Sequence[str] | None = None) -> list[dict[str, Any]]:
    configs = []
    for subject in subjects or mmlu_subjects(data_dir):
        source = data_dir / "mmlu" / "test" / f"{subject}_test.csv"
        test = converted_jsonl(source, read_mmlu_csv, cache_dir, f"mmlu_{subject}")
        configs.append(_task_config(
            f"kbbq_mmlu_{subject}", {"test": test}, cache_dir, num_fewshot,
            fewshot_config={"sampler": "first_n"},
            output_type="multiple_choice",
            description="The following are multiple choice questions (with answers) about "
                        f"{subject.replace('_', ' ')}.\n\n",
            doc_to_text="{{question.strip()}}\nA. {{choices[0]}}\nB. {{choices[1]}}\n"
                        "C. {{choices[2]}}\nD. {{choices[3]}}\nAnswer:",
            doc_to_choice=["A", "B", "C", "D"],
            doc_to_target="answer",
            metric_list=_ACC,
        ))
    return configs


def gsm8k_config(
    data_dir: Path, cache_dir: Path, num_fewshot: int, max_gen_toks: int
) -> dict[str, Any]:
    files = {"train": data_file(data_dir, "gsm8k", 0), "test": data_file(data_dir, "gsm8k", 1)}
    return _task_config(
        "kbbq_gsm8k_cot", files, cache_dir, num_fewshot, fewshot_split="train",
        fewshot_config={"sampler": "first_n", "doc_to_target": gsm8k_rationale},
        output_type="generate_until",
        doc_to_text="Q: {{question}}\nA:",
        doc_to_target=gsm8k_final_answer,
        generation_kwargs={"until": ["Q:", "</s>", "<|im_end|>", "\n\n"], "do_sample": False,
                           "max_gen_toks": max_gen_toks},
        filter_list=[
            {"name": "strict-match", "filter": [
                {"function": "regex", "regex_pattern": r"The answer is (\-?[0-9\.\,]+)."},
                {"function": "take_first"}]},
            {"name": "flexible-extract", "filter": [
                {"function": "regex", "group_select": -1,
                 "regex_pattern": r"(-?[$0-9.,]{2,})|(-?[0-9]+)"},
                {"function": "take_first"}]},
        ],
        metric_list=[{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True,
                      "ignore_case": True, "ignore_punctuation": False,
                      "regexes_to_ignore": [",", r"\$", "(?s).*#### ", r"\.$"]}],
    )


def hellaswag_config(data_dir: Path, cache_dir: Path, num_fewshot: int) -> dict[str, Any]:
    source = data_file(data_dir, "hellaswag")
    test = converted_jsonl(source, read_hellaswag_text, cache_dir, "hellaswag_val")
    return _task_config(
        "kbbq_hellaswag", {"test": test}, cache_dir, num_fewshot,
        output_type="multiple_choice",
        doc_to_text="{{query}}",
        doc_to_choice="choices",
        doc_to_target="label",
        metric_list=_ACC_AND_NORM,
    )


def winogrande_config(data_dir: Path, cache_dir: Path, num_fewshot: int) -> dict[str, Any]:
    test = data_file(data_dir, "winogrande")
    return _task_config(
        "kbbq_winogrande", {"test": test}, cache_dir, num_fewshot,
        fewshot_config={"sampler": _winogrande_sampler()},
        output_type="multiple_choice",
        doc_to_text=winogrande_gold,
        doc_to_choice=winogrande_options,
        doc_to_target="{{continuation}}",
        metric_list=_ACC,
    )


def mbpp_config(
    data_dir: Path, cache_dir: Path, num_fewshot: int, max_gen_toks: int
) -> dict[str, Any]:
    source = data_file(data_dir, "mbpp")
    return _task_config(
        "kbbq_mbpp", {"test": source, "prompt": source}, cache_dir, num_fewshot,
        fewshot_split="prompt",
        process_docs=_keep_task_ids(MBPP_TEST_IDS),
        fewshot_config={"sampler": "first_n", "process_docs": _keep_task_ids(MBPP_SHOT_IDS),
                        "doc_to_target": _mbpp_shot_target},
        unsafe_code=True,
        output_type="generate_until",
        doc_to_text=_mbpp_prompt,
        doc_to_target=_mbpp_tests,
        target_delimiter="",
        process_results=mbpp_pass_at_1,
        metric_list=[{"metric": "pass_at_1", "aggregation": "mean", "higher_is_better": True}],
        generation_kwargs={"until": ["[DONE]"], "do_sample": False,
                           "max_gen_toks": max_gen_toks},
    )


def choice_config(task: str, data_dir: Path, cache_dir: Path,
                  num_fewshot: int) -> dict[str, Any]:
    """ARC-Easy, ARC-Challenge or PIQA from llm-foundry's ``{query, choices, gold}`` file."""
    test = data_file(data_dir, task)
    return _task_config(
        f"kbbq_{task}", {"test": test}, cache_dir, num_fewshot,
        output_type="multiple_choice",
        doc_to_text="{{query.strip()}}\nAnswer:",
        doc_to_choice="choices",
        doc_to_target="gold",
        metric_list=_ACC_AND_NORM,
    )


def lambada_config(data_dir: Path, cache_dir: Path, num_fewshot: int) -> dict[str, Any]:
    """LAMBADA (OpenAI) from llm-foundry's ``{context, continuation}`` file."""
    test = data_file(data_dir, "lambada")
    return _task_config(
        "kbbq_lambada", {"test": test}, cache_dir, num_fewshot,
        output_type="loglikelihood",
        doc_to_text="{{context}}",
        doc_to_target="{{' ' + continuation}}",
        metric_list=[{"metric": "perplexity", "aggregation": "perplexity",
                      "higher_is_better": False},
                     {"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
    )


def task_configs(
    tasks: Sequence[str],
    data_dir: str | Path,
    cache_dir: str | Path | None = None,
    num_fewshot: Mapping[str, int] | None = None,
    max_gen_toks: int = 256,
    mmlu_subjects: Sequence[str] | None = None,
) -> dict[str, list[dict[str, Any]]]:
    """lm-eval task configs (dicts) per benchmark name, reading ``data_dir`` (checked first,
    :func:`check_data`); MMLU gives one config per subject, the others one each."""
    data = check_data(tasks, data_dir, mmlu_subjects)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    shots = {**DEFAULT_FEWSHOT, **(num_fewshot or {})}
    builders = {
        "mmlu": lambda: mmlu_configs(data, cache, shots["mmlu"], mmlu_subjects),
        "gsm8k": lambda: [gsm8k_config(data, cache, shots["gsm8k"], max_gen_toks)],
        "hellaswag": lambda: [hellaswag_config(data, cache, shots["hellaswag"])],
        "winogrande": lambda: [winogrande_config(data, cache, shots["winogrande"])],
        "mbpp": lambda: [mbpp_config(data, cache, shots["mbpp"], max_gen_toks)],
        "lambada": lambda: [lambada_config(data, cache, shots["lambada"])],
        **{name: (lambda name=name: [choice_config(name, data, cache, shots[name])])
           for name in ("arc_easy", "arc_challenge", "piqa")},
    }
    return {task: builders[task]() for task in tasks}


# ---------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------

def code_execution_allowed(allow: bool | None = None) -> bool:
    return bool(allow) or os.environ.get(CODE_EVAL_ENV) == "1"


def _task_metrics(task_results: Mapping[str, Any]) -> dict[str, float]:
    metrics = {}
    for key, value in task_results.items():
        if key in ("alias", "sample_len") or not isinstance(value, (int, float)):
            continue
        name = key[: -len(",none")] if key.endswith(",none") else key
        metrics[name] = float(value)
    return metrics


def summarize(
    results: Mapping[str, Any], configs: Mapping[str, list[dict[str, Any]]]
) -> dict[str, dict[str, Any]]:
    """Per benchmark: ``score`` (its primary metric), ``metric`` (its name), every metric
    lm-eval reported, ``n_docs`` (evaluated), ``n_available`` (in the data) and
    ``num_fewshot``; MMLU's metrics are the question-weighted
    averages over subjects, with per-subject accuracies under ``subjects``."""
    summary: dict[str, dict[str, Any]] = {}
    for benchmark, task_list in configs.items():
        names = [c["task"] for c in task_list]
        counts = {n: int(results["n-samples"][n]["effective"]) for n in names}
        available = sum(int(results["n-samples"][n]["original"]) for n in names)
        per_task = {n: _task_metrics(results["results"][n]) for n in names}
        total = sum(counts.values())
        keys = set.intersection(*(set(m) for m in per_task.values()))
        metrics = {k: sum(per_task[n][k] * counts[n] for n in names) / total
                   for k in sorted(keys) if not k.split(",")[0].endswith("_stderr")}
        if len(names) == 1:
            metrics = per_task[names[0]]
        primary = PRIMARY_METRIC[benchmark]
        entry: dict[str, Any] = {"score": metrics[primary], "metric": primary, **metrics,
                                 "n_docs": total, "n_available": available,
                                 "num_fewshot": task_list[0]["num_fewshot"]}
        if benchmark == "mmlu":
            prefix = "kbbq_mmlu_"
            entry["subjects"] = {n[len(prefix):]: per_task[n]["acc"] for n in names}
        summary[benchmark] = entry
    return summary


def run_benchmarks(
    model: Any,
    tokenizer: Any,
    tasks: Sequence[str] = BENCHMARKS,
    limit: int | float | None = None,
    data_dir: str | Path = "../shared/data",
    num_fewshot: Mapping[str, int] | None = None,
    batch_size: int = 8,
    *,
    cache_dir: str | Path | None = None,
    max_gen_toks: int = 256,
    mmlu_subjects: Sequence[str] | None = None,
    allow_code_execution: bool | None = None,
    seed: int = 1234,
    bootstrap_iters: int = 1000,
    apply_chat_template: bool = False,
    fewshot_as_multiturn: bool | None = None,
    system_instruction: str | None = None,
) -> dict[str, dict[str, Any]]:
    """Evaluate an in-memory causal LM on the benchmarks ``tasks`` (names from
    :data:`BENCHMARKS`) with lm-evaluation-harness, offline; see the module documentation.

    ``model`` is a HuggingFace causal LM, run through lm-eval's ``HFLM`` with ``tokenizer``, or
    any ``lm_eval.api.model.LM`` (then ``tokenizer`` and ``batch_size`` are not used).

    ``limit`` caps the documents per lm-eval task (MMLU: per subject), ``num_fewshot``
    overrides :data:`DEFAULT_FEWSHOT` per benchmark.  Generation is greedy with at most
    ``max_gen_toks`` new tokens (less when the model's context is short: at most half of it).
    MBPP needs ``allow_code_execution=True`` or ``HF_ALLOW_CODE_EVAL=1``.

    An instruct model is scored as it is served with ``apply_chat_template=True``: each prompt
    rendered by the tokenizer's chat template, the shots as earlier turns of the conversation
    (``fewshot_as_multiturn``, which follows ``apply_chat_template`` unless set), after a
    ``system_instruction`` if given; lm-eval's ``--apply_chat_template``,
    ``--fewshot_as_multiturn`` and ``--system_instruction``.  Returns :func:`summarize`'s dict
    (each entry's ``chat_template`` and ``fewshot_as_multiturn`` say how it was scored), and
    keeps lm-eval's full output under the key ``"lm_eval"``.
    """
    tasks = list(dict.fromkeys(tasks))
    if fewshot_as_multiturn is None:
        fewshot_as_multiturn = apply_chat_template
    if fewshot_as_multiturn and not apply_chat_template:
        raise ValueError("fewshot_as_multiturn needs apply_chat_template: the shots become "
                         "turns of a chat")
    if (apply_chat_template and tokenizer is not None
            and not getattr(tokenizer, "chat_template", None)):
        raise ValueError(f"apply_chat_template: tokenizer "
                         f"{getattr(tokenizer, 'name_or_path', '') or type(tokenizer).__name__!r}"
                         " has no chat template")
    check_data(tasks, data_dir, mmlu_subjects)  # before lm-eval is imported (and warns)
    if "mbpp" in tasks and not code_execution_allowed(allow_code_execution):
        raise PermissionError(
            "MBPP pass@1 executes model-generated Python code on this machine (separate "
            "process, time and memory limits, no sandbox). Opt in with "
            f"allow_code_execution=True (CLI: --allow-code-execution) or {CODE_EVAL_ENV}=1"
        )
    from lm_eval import simple_evaluate
    from lm_eval.api.model import LM
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    lm = model if isinstance(model, LM) else HFLM(pretrained=model, tokenizer=tokenizer,
                                                   batch_size=batch_size)
    context = getattr(lm, "max_length", None)
    if isinstance(context, int) and max_gen_toks >= context:
        reduced = max(1, context // 2)
        log.warning("max_gen_toks %d >= the model's context %d: generating at most %d tokens",
                    max_gen_toks, context, reduced)
        max_gen_toks = reduced
    configs = task_configs(tasks, data_dir, cache_dir, num_fewshot, max_gen_toks,
                           mmlu_subjects)
    flat = [config for task in tasks for config in configs[task]]
    try:
        results = simple_evaluate(
            model=lm, tasks=flat, limit=limit, task_manager=TaskManager(include_defaults=False),
            confirm_run_unsafe_code="mbpp" in tasks, random_seed=seed, numpy_random_seed=seed,
            torch_random_seed=seed, fewshot_random_seed=seed, bootstrap_iters=bootstrap_iters,
            log_samples=False, apply_chat_template=apply_chat_template,
            fewshot_as_multiturn=fewshot_as_multiturn, system_instruction=system_instruction,
        )
    except AssertionError as error:  # lm-eval checks what it is given by assert
        where = traceback.extract_tb(error.__traceback__)[-1]
        reads = f"; the model reads {context} tokens" if isinstance(context, int) else ""
        raise ValueError(f"lm-eval stopped on {', '.join(tasks)}: "
                         f"{str(error) or where.line} ({Path(where.filename).name}:"
                         f"{where.lineno}){reads}") from error
    summary = summarize(results, configs)
    for entry in summary.values():
        entry.update(chat_template=apply_chat_template, fewshot_as_multiturn=fewshot_as_multiturn)
    for entry in summary.values():
        for key, value in entry.items():
            if isinstance(value, float) and not math.isfinite(value):
                log.warning("non-finite metric %s=%s", key, value)
    return {**summary, "lm_eval": {"results": results["results"],
                                   "n-samples": results["n-samples"],
                                   "config": _jsonable(results.get("config", {}))}}


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))
