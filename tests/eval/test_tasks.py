"""The offline lm-eval benchmarks (kbbq_pl.eval.tasks) on the converted tiny llama2.c model."""

from __future__ import annotations

import bz2
import csv
import json

import pytest
from conftest import SHARED_DATA

from kbbq_pl.cli.commands import main
from kbbq_pl.eval import tasks as B

TINY = SHARED_DATA / "tiny_llama_aidreams260K"


@pytest.fixture(scope="module")
def data_dir():
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data folder {SHARED_DATA} is absent")
    return SHARED_DATA


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("eval_cache")


@pytest.fixture(scope="module")
def tiny_llama(data_dir, tmp_path_factory):
    from kbbq_pl.io.llama2c import convert_llama2c
    from kbbq_pl.io.models import load_model

    if not (TINY / "aidreams260K.bin").is_file():
        pytest.skip(f"the tiny llama2.c model is absent ({TINY})")
    folder = convert_llama2c(TINY / "aidreams260K.bin", TINY / "tok512.bin",
                             tmp_path_factory.mktemp("model") / "tiny")
    model, tokenizer = load_model(folder)
    return folder, model, tokenizer


# --- data readers --------------------------------------------------------------------------

def test_read_mmlu_csv(data_dir, tmp_path):
    path = data_dir / "mmlu" / "test" / "anatomy_test.csv"
    docs = B.read_mmlu_csv(path)
    with path.open(encoding="utf-8", newline="") as handle:
        rows = list(csv.reader(handle))
    assert len(docs) == len(rows) - 1 == 135
    assert docs[0]["question"] == rows[1][0] and docs[0]["choices"] == rows[1][1:5]
    assert [d["answer"] for d in docs[:3]] == ["ABCD".index(r[5]) for r in rows[1:4]]
    assert len(B.mmlu_subjects(data_dir)) == 57

    bad = tmp_path / "bad_test.csv"
    bad.write_text("q,a,b,c,d,answer\n", encoding="utf-8")
    with pytest.raises(ValueError, match="bad_test.csv: first row must be the header"):
        B.read_mmlu_csv(bad)
    bad.write_text("Question,A,B,C,D,Answer\nWhat?,1,2,3,4,E\n", encoding="utf-8")
    with pytest.raises(ValueError, match="bad_test.csv:2: expected 6 fields"):
        B.read_mmlu_csv(bad)


def test_read_hellaswag_text(data_dir, tmp_path):
    path = data_dir / "hellaswag" / "hellaswag_val_full.txt.bz2"
    docs = B.read_hellaswag_text(path)
    assert len(docs) == 10042
    with bz2.open(path, "rt", encoding="utf-8") as handle:
        first = [next(handle).rstrip("\n") for _ in range(6)]
    assert docs[0] == {"query": first[0].strip(), "label": int(first[1]),
                       "choices": [e.strip() for e in first[2:]]}
    assert {d["label"] for d in docs} == {0, 1, 2, 3}
    assert all(len(d["choices"]) == 4 for d in docs)

    bad = tmp_path / "h.txt"
    bad.write_text("ctx\n7\na\nb\nc\nd\n", encoding="utf-8")
    with pytest.raises(ValueError, match="h.txt:2: gold index must be 0-3"):
        B.read_hellaswag_text(bad)
    bad.write_text("ctx\n1\na\nb\n", encoding="utf-8")
    with pytest.raises(ValueError, match="not a multiple of 6"):
        B.read_hellaswag_text(bad)


def test_conversion_is_cached_and_deterministic(data_dir, tmp_path):
    source = data_dir / "mmlu" / "test" / "anatomy_test.csv"
    first = B.converted_jsonl(source, B.read_mmlu_csv, tmp_path, "mmlu_anatomy")
    content = first.read_bytes()
    assert first.parent == tmp_path and first.suffix == ".jsonl"
    assert [json.loads(line) for line in content.splitlines()] == B.read_mmlu_csv(source)
    again = B.converted_jsonl(source, B.read_mmlu_csv, tmp_path / "other", "mmlu_anatomy")
    assert again.name == first.name and again.read_bytes() == content
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())


def test_gsm8k_rationale():
    doc = {"question": "?", "answer": "He has 2*3=<<2*3=6>>6 apples\nThen 6+1=<<6+1=7>>7.\n"
                                      "#### 7"}
    assert B.gsm8k_final_answer(doc) == "7"
    assert B.gsm8k_rationale(doc) == "He has 2*3=6 apples. Then 6+1=7. The answer is 7."


def test_code_execution():
    assert B.run_python_tests("def f(x):\n    return x + 1\nassert f(1) == 2")
    assert not B.run_python_tests("def f(x):\n    return x\nassert f(1) == 2")
    assert not B.run_python_tests("while True:\n    pass", timeout=1)
    doc = {"test_setup_code": "", "test_list": ["assert add(2, 3) == 5"]}
    assert B.mbpp_pass_at_1(doc, ["def add(a, b):\r\n    return a + b\n[DONE]junk"]) == \
        {"pass_at_1": 1.0}
    assert B.mbpp_pass_at_1(doc, ["def add(a, b):\n    return a * b\n"]) == {"pass_at_1": 0.0}


# --- prompts -------------------------------------------------------------------------------

def _task(config):
    from lm_eval.api.task import ConfigurableTask

    task = ConfigurableTask(config=config)
    task.set_fewshot_seed(1234)
    return task


def test_mmlu_shots_are_other_rows_of_the_subject(data_dir, cache_dir):
    (config,) = B.task_configs(["mmlu"], data_dir, cache_dir, mmlu_subjects=["anatomy"])["mmlu"]
    task = _task(config)
    rows = B.read_mmlu_csv(data_dir / "mmlu" / "test" / "anatomy_test.csv")
    assert len(task.eval_docs) == len(rows)
    for index in (0, 3, 50):
        prompt = task.fewshot_context(task.eval_docs[index], 5)
        assert prompt.startswith("The following are multiple choice questions (with answers) "
                                 "about anatomy.\n\n")
        assert prompt.count("\nAnswer:") == 6 and prompt.endswith("\nAnswer:")
        shots = [r for r in rows[:6] if r is not rows[index]][:5]
        for shot in shots:
            assert shot["question"].strip() + "\nA. " in prompt
        assert prompt.count(rows[index]["question"].strip()) == 1


def test_gsm8k_shots_come_from_train(data_dir, cache_dir):
    (config,) = B.task_configs(["gsm8k"], data_dir, cache_dir)["gsm8k"]
    task = _task(config)
    assert len(task.eval_docs) == 1319
    train = [json.loads(line) for line in
             (data_dir / "gsm8k" / "train.jsonl").read_text(encoding="utf-8").splitlines()[:8]]
    prompt = task.fewshot_context(task.eval_docs[0], 8)
    for shot in train:
        assert f"Q: {shot['question']}\nA: {B.gsm8k_rationale(shot)}\n\n" in prompt
    assert prompt.endswith(f"Q: {task.eval_docs[0]['question']}\nA:")


def test_winogrande_shots_skip_the_item_and_its_twin(data_dir, cache_dir):
    (config,) = B.task_configs(["winogrande"], data_dir, cache_dir)["winogrande"]
    task = _task(config)
    assert len(task.eval_docs) == 1267
    doc = task.eval_docs[0]
    contexts = task.fewshot_context(doc, 5)
    assert len(contexts) == 2
    shared = contexts[0].rsplit("\n\n", 1)[0]
    assert contexts[1].startswith(shared) and shared.count("\n\n") == 4
    for option in doc["context_options"]:
        assert option not in shared


def test_reference_solutions_pass_mbpp_tests(data_dir):
    docs = [json.loads(line) for line in
            (data_dir / "mbpp" / "mbpp.jsonl").read_text(encoding="utf-8").splitlines()]
    for doc in [d for d in docs if d["task_id"] in (11, 12, 13)]:
        assert B.mbpp_pass_at_1(doc, [doc["code"]]) == {"pass_at_1": 1.0}
        assert B.mbpp_pass_at_1(doc, ["pass"]) == {"pass_at_1": 0.0}


# --- end to end ----------------------------------------------------------------------------

def _oracle():
    """An lm-eval LM that knows every answer: scores show the gold choice best, generations
    are the reference solutions.  A task config that mis-wires its targets scores below 1."""
    from lm_eval.api.model import LM

    def gold(doc):
        for key in ("answer", "label", "gold"):
            if key in doc and isinstance(doc[key], int):
                return doc[key]
        raise KeyError(sorted(doc))

    class Oracle(LM):
        def loglikelihood(self, requests, disable_tqdm=False):
            # LAMBADA (no choices): the continuation is the greedy one
            return [(0.0, True) if "choices" not in r.doc and "context_options" not in r.doc
                    else (0.0 if r.idx == gold(r.doc) else -10.0, False) for r in requests]

        def loglikelihood_rolling(self, requests, disable_tqdm=False):
            raise NotImplementedError

        def generate_until(self, requests, disable_tqdm=False):
            return [B.gsm8k_rationale(r.doc) if "question" in r.doc else r.doc["code"]
                    for r in requests]

    return Oracle()


def test_an_oracle_scores_one_on_every_task(data_dir, cache_dir):
    summary = B.run_benchmarks(_oracle(), None, B.BENCHMARKS, limit=3, data_dir=data_dir,
                               cache_dir=cache_dir, allow_code_execution=True,
                               mmlu_subjects=["anatomy", "virology"])
    for task in B.BENCHMARKS:
        assert summary[task]["score"] == 1.0, task
    assert summary["gsm8k"]["exact_match,flexible-extract"] == 1.0
    assert summary["hellaswag"]["acc"] == 1.0
    for task in ("arc_easy", "arc_challenge", "piqa"):
        assert summary[task]["acc"] == 1.0, task


def test_chat_template_renders_prompts_and_shots(data_dir, cache_dir):
    """``apply_chat_template``: every prompt goes through the model's chat template, the shots
    as earlier turns (unless ``fewshot_as_multiturn=False``), after the system instruction;
    without it no prompt is a chat.  The oracle still scores one: the targets are unchanged."""
    oracle = type(_oracle())

    class ChatOracle(oracle):
        contexts: list[str] = []

        def apply_chat_template(self, chat_history, add_generation_prompt=True):
            return "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in chat_history) \
                + ("<assistant>" if add_generation_prompt else "")

        @property
        def tokenizer_name(self):
            return "chat-oracle"

        def chat_template(self, chat_template=False):
            return "chat-oracle-template"

        def loglikelihood(self, requests, disable_tqdm=False):
            self.contexts += [r.args[0] for r in requests]
            return super().loglikelihood(requests, disable_tqdm)

        def generate_until(self, requests, disable_tqdm=False):
            self.contexts += [r.args[0] for r in requests]
            return super().generate_until(requests, disable_tqdm)

    def run(**chat):
        lm = ChatOracle()
        lm.contexts = []
        summary = B.run_benchmarks(lm, None, ["gsm8k", "arc_easy"], limit=2, data_dir=data_dir,
                                   cache_dir=cache_dir, **chat)
        assert summary["gsm8k"]["score"] == summary["arc_easy"]["score"] == 1.0
        assert all(entry["chat_template"] is bool(chat) for entry in summary.values()
                   if "score" in entry)
        return lm.contexts

    assert not any("<user>" in context for context in run())
    turns = run(apply_chat_template=True, system_instruction="Be brief.")
    gsm8k = [c for c in turns if "The answer is" in c]
    assert gsm8k and all(c.startswith("<system>Be brief.</system><user>") for c in turns)
    assert all(c.count("<user>") == 9 and c.count("</assistant>") == 8 for c in gsm8k)
    one_turn = [c for c in run(apply_chat_template=True, fewshot_as_multiturn=False)
                if "The answer is" in c]
    assert one_turn and all(c.count("<user>") == 1 for c in one_turn)
    with pytest.raises(ValueError, match="fewshot_as_multiturn needs apply_chat_template"):
        B.run_benchmarks(ChatOracle(), None, ["gsm8k"], limit=1, data_dir=data_dir,
                         fewshot_as_multiturn=True)


def test_chat_template_needs_one(data_dir, tiny_llama):
    _, model, tokenizer = tiny_llama
    assert not tokenizer.chat_template
    with pytest.raises(ValueError, match="has no chat template"):
        B.run_benchmarks(model, tokenizer, ["arc_easy"], limit=1, data_dir=data_dir,
                         apply_chat_template=True)


def _check(summary, task, n_docs, n_available):
    entry = summary[task]
    assert 0.0 <= entry["score"] <= 1.0
    assert entry["score"] == entry[entry["metric"]]
    assert entry["n_docs"] == n_docs and entry["n_available"] == n_available
    assert entry["num_fewshot"] == B.DEFAULT_FEWSHOT[task]


def test_multiple_choice_tasks_end_to_end(tiny_llama, data_dir, cache_dir):
    _, model, tokenizer = tiny_llama
    summary = B.run_benchmarks(model, tokenizer, ["mmlu", "hellaswag", "winogrande"], limit=3,
                               data_dir=data_dir, cache_dir=cache_dir, batch_size=8,
                               mmlu_subjects=["abstract_algebra", "anatomy"])
    _check(summary, "mmlu", 6, 100 + 135)
    assert set(summary["mmlu"]["subjects"]) == {"abstract_algebra", "anatomy"}
    _check(summary, "hellaswag", 3, 10042)
    assert 0.0 <= summary["hellaswag"]["acc"] <= 1.0
    _check(summary, "winogrande", 3, 1267)
    assert set(summary["lm_eval"]["results"]) == {
        "kbbq_mmlu_abstract_algebra", "kbbq_mmlu_anatomy", "kbbq_hellaswag", "kbbq_winogrande"}


def test_zero_shot_likelihood_tasks_end_to_end(tiny_llama, data_dir, cache_dir):
    _, model, tokenizer = tiny_llama
    tasks = ["arc_easy", "arc_challenge", "piqa", "lambada"]
    summary = B.run_benchmarks(model, tokenizer, tasks, limit=3, data_dir=data_dir,
                               cache_dir=cache_dir, batch_size=8)
    for task, available in [("arc_easy", 2376), ("arc_challenge", 1172), ("piqa", 1838),
                            ("lambada", 5153)]:
        _check(summary, task, 3, available)
    assert summary["lambada"]["perplexity"] > 1.0
    for task in ("arc_easy", "arc_challenge", "piqa"):
        assert 0.0 <= summary[task]["acc"] <= 1.0


def test_generation_tasks_end_to_end(tiny_llama, data_dir, cache_dir):
    _, model, tokenizer = tiny_llama
    with pytest.raises(PermissionError, match="HF_ALLOW_CODE_EVAL"):
        B.run_benchmarks(model, tokenizer, ["mbpp"], limit=2, data_dir=data_dir)
    summary = B.run_benchmarks(model, tokenizer, ["gsm8k", "mbpp"], limit=2, data_dir=data_dir,
                               cache_dir=cache_dir, max_gen_toks=16, allow_code_execution=True)
    _check(summary, "gsm8k", 2, 1319)
    assert 0.0 <= summary["gsm8k"]["exact_match,flexible-extract"] <= 1.0
    _check(summary, "mbpp", 2, 500)


def test_unknown_task_and_missing_data(tmp_path, tiny_llama):
    with pytest.raises(ValueError, match=r"unknown benchmark.*lm_eval --model hf --model_args "
                                         r"pretrained=FOLDER,trust_remote_code=True "
                                         r"--tasks lambada_standard$"):
        B.task_configs(["mmlu", "lambada_standard"], tmp_path)
    with pytest.raises(FileNotFoundError, match="HellaSwag: .*hellaswag_val_full.txt.bz2"):
        B.task_configs(["hellaswag"], tmp_path, tmp_path / "cache")
    with pytest.raises(FileNotFoundError, match="piqa: .*llm_foundry_eval/piqa.jsonl"):
        B.task_configs(["piqa"], tmp_path, tmp_path / "cache")
    (tmp_path / "mmlu" / "test").mkdir(parents=True)
    (tmp_path / "mmlu" / "test" / "astronomy_test.csv").write_text("Question,A,B,C,D,Answer\n")
    with pytest.raises(ValueError, match=r"MMLU subject\(s\) \['astronmy'\] \(--mmlu-subjects\) "
                                         r"are not among the 1 of"):
        B.check_data(["mmlu"], tmp_path, ["astronmy"])


def test_cli_eval(tiny_llama, data_dir, cache_dir, tmp_path, capsys):
    folder, _, _ = tiny_llama
    out = tmp_path / "results.json"
    assert main(["eval", "--model", str(folder), "--tasks", "winogrande", "--limit", "2",
                 "--data-dir", str(data_dir), "--cache-dir", str(cache_dir),
                 "--num-fewshot", "winogrande=1", "--out", str(out)]) == 0
    results = json.loads(out.read_text(encoding="utf-8"))
    assert results["winogrande"]["num_fewshot"] == 1 and results["winogrande"]["n_docs"] == 2
    assert 0.0 <= results["winogrande"]["score"] <= 1.0 and results["wall_time_s"] > 0
    assert "winogrande" in capsys.readouterr().out


def test_cli_eval_names_what_lm_eval_and_the_arguments_refuse(tiny_llama, data_dir, cache_dir,
                                                               tmp_path, capsys):
    """An assertion inside lm-eval (more shots than the subject holds) is a one-line error
    naming it (exit 2; it was "internal error (AssertionError)", exit 1); no task, and a
    --text that is a folder or empty, are refused before the model loads."""
    folder, _, _ = tiny_llama
    assert main(["eval", "--model", str(folder), "--tasks", "mmlu", "--mmlu-subjects",
                 "anatomy", "--limit", "1", "--num-fewshot", "mmlu=1000", "--data-dir",
                 str(data_dir), "--cache-dir", str(cache_dir)]) == 2
    assert "error: lm-eval stopped on mmlu: " in capsys.readouterr().err
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    for argv, message in ((["--tasks", " , "], "--tasks ' , ' names no task"),
                          (["--tasks", "ppl", "--text", str(tmp_path)], "is a folder"),
                          (["--tasks", "ppl", "--text", str(empty)], "is empty")):
        assert main(["eval", "--model", str(folder), *argv]) == 2
        assert message in capsys.readouterr().err


def test_cli_eval_with_the_chat_template(tiny_llama, data_dir, cache_dir, tmp_path, capsys):
    import shutil

    folder, _, _ = tiny_llama
    chat = tmp_path / "chat-model"
    shutil.copytree(folder, chat)
    (chat / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}", encoding="utf-8")
    out = tmp_path / "results.json"
    common = ["eval", "--model", str(chat), "--tasks", "winogrande", "--limit", "2",
              "--data-dir", str(data_dir), "--cache-dir", str(cache_dir)]
    assert main([*common, "--fewshot-as-multiturn", "true"]) == 2
    assert "--fewshot-as-multiturn true needs --apply-chat-template" in capsys.readouterr().err
    assert main([*common, "--apply-chat-template", "--system-instruction", "Choose.",
                 "--out", str(out)]) == 0
    assert json.loads(out.read_text(encoding="utf-8"))["winogrande"]["chat_template"] is True
    assert "scored through the tokenizer's chat template, shots as turns" in (
        capsys.readouterr().out)
    assert main(["eval", "--model", str(folder), "--tasks", "winogrande", "--limit", "1",
                 "--data-dir", str(data_dir), "--apply-chat-template"]) == 2
    assert "has no chat template" in capsys.readouterr().err


@pytest.mark.gpu
def test_cli_eval_on_cuda(tiny_llama, data_dir, cache_dir, tmp_path):
    """--device cuda: the model and lm-eval's inputs on the GPU."""
    folder, _, _ = tiny_llama
    out = tmp_path / "results.json"
    assert main(["eval", "--model", str(folder), "--tasks", "winogrande", "--limit", "2",
                 "--data-dir", str(data_dir), "--cache-dir", str(cache_dir), "--device", "cuda",
                 "--out", str(out), "--debug"]) == 0
    results = json.loads(out.read_text(encoding="utf-8"))
    assert results["device"] == "cuda" and results["winogrande"]["n_docs"] == 2


@pytest.mark.slow
def test_all_five_benchmarks_all_subjects(tiny_llama, data_dir, cache_dir):
    _, model, tokenizer = tiny_llama
    summary = B.run_benchmarks(model, tokenizer, B.BENCHMARKS, limit=2, data_dir=data_dir,
                               cache_dir=cache_dir, allow_code_execution=True)
    _check(summary, "mmlu", 2 * 57, 14042)
    for task, available in [("gsm8k", 1319), ("hellaswag", 10042), ("winogrande", 1267),
                            ("mbpp", 500)]:
        _check(summary, task, 2, available)
