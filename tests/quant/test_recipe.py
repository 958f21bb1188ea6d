"""The recipe, :class:`QuantizationConfig`, is declared once: every leaf field is settable from
recipe YAML, from the command line, through the ``KBBQ`` callback and through torchao's
``KBBQConfig``; unknown and removed fields are refused with one line."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from jsonargparse import ArgumentParser
from kbbq_pl.callbacks import KBBQ

from kbbq_pl.cli.commands import main
from kbbq_pl.cli.quantize import _parser
from kbbq_pl.quant.config import LayersConfig, QuantizationConfig, TransformConfig
from kbbq_pl.quant.torchao import KBBQConfig

ROOT = Path(__file__).resolve().parents[2]

# A valid value other than the default for every leaf field; a new field must get one here.
OTHER_VALUES: dict[str, Any] = {
    "format.name": "mxfp4", "format.act_scale": "dynamic", "format.unaligned": "skip",
    "transform.name": "wush", "transform.lam": 0.5, "transform.damping": 0.02,
    "transform.seed": 3, "transform.fold_o_proj": True,
    "weights.quantizer": "gptq", "weights.propagate": "quantized", "weights.damping": 0.05,
    "weights.act_order": False, "weights.block_size": 256, "weights.scale_search": "mse",
    "weights.group_scales": "dynamic", "weights.transform_refit": "fixed",
    "autobrake.grid": (0.25, 0.5), "autobrake.holdout": 0.25, "autobrake.tokens": 64,
    "layers.targets": [r"q_proj"], "layers.ignore": [r"lm_head"],
    "keep_samples": 7,
}
# A field whose other value is valid only beside another field's other value.
NEEDS: dict[str, str] = {}
# What torchao's per-layer RTN cannot do: KBBQConfig refuses it, naming quantize_model.
PIPELINE_ONLY = {"weights.quantizer", "weights.scale_search", "weights.propagate",
                 "transform.fold_o_proj"}


def leaf_fields(cls: type = QuantizationConfig, prefix: str = "") -> list[str]:
    """The dotted names of every leaf field of the recipe (dataclasses, recursively)."""
    names = []
    for field in dataclasses.fields(cls):
        group = field.default_factory
        if dataclasses.is_dataclass(group):
            names += leaf_fields(group, f"{prefix}{field.name}.")
        else:
            names.append(prefix + field.name)
    return names


LEAVES = leaf_fields()


def value_at(config: QuantizationConfig, name: str) -> Any:
    for part in name.split("."):
        config = getattr(config, part)
    return config


def nested(name: str, value: Any) -> dict[str, Any]:
    """``{group: {leaf: value}}``, with the field it needs (:data:`NEEDS`) beside it."""
    fields = {name: value}
    if name in NEEDS:
        fields[NEEDS[name]] = OTHER_VALUES[NEEDS[name]]
    out: dict[str, Any] = {}
    for key, item in fields.items():
        group, _, leaf = key.rpartition(".")
        if group:
            out.setdefault(group, {})[leaf] = item
        else:
            out[leaf] = item
    return out


def with_value(name: str, value: Any) -> QuantizationConfig:
    return QuantizationConfig.from_dict(nested(name, value))


def cli_args(prefix: str, name: str, value: Any) -> list[str]:
    """``--PREFIX.NAME VALUE``, with the field it needs (:data:`NEEDS`) before it."""
    args = [f"--{prefix}.{NEEDS[name]}", cli_value(OTHER_VALUES[NEEDS[name]])] \
        if name in NEEDS else []
    return args + [f"--{prefix}.{name}", cli_value(value)]


def cli_value(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(list(value) if isinstance(
        value, tuple) else value)


def same(got: Any, expected: Any) -> bool:
    return list(got) == list(expected) if isinstance(expected, (list, tuple)) else (
        got == expected and type(got) is type(expected))


def test_every_leaf_has_a_test_value_and_a_description():
    assert sorted(OTHER_VALUES) == sorted(LEAVES)
    assert sorted(QuantizationConfig.field_descriptions()) == sorted(LEAVES)
    assert all(QuantizationConfig.field_descriptions().values())
    defaults = QuantizationConfig()
    assert all(value_at(defaults, name) != value for name, value in OTHER_VALUES.items())


@pytest.mark.parametrize("name", LEAVES)
def test_every_leaf_is_settable_from_yaml_cli_kbbq_and_torchao(name, tmp_path):
    value = OTHER_VALUES[name]
    parser = _parser("kbbq-pl quantize")

    # recipe YAML (a file, as --config reads it)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"recipe": nested(name, list(value) if isinstance(
        value, tuple) else value)}))
    from_yaml = parser.instantiate(parser.parse_args(["--config", str(recipe)])).recipe
    assert same(value_at(from_yaml, name), value), from_yaml

    # the command line
    from_cli = parser.instantiate(parser.parse_args(cli_args("recipe", name, value))).recipe
    assert same(value_at(from_cli, name), value), from_cli
    assert from_cli == from_yaml == with_value(name, value)

    # the KBBQ callback: in Python, and as LightningCLI builds it from its signature
    assert value_at(KBBQ(from_cli, model_attr="net").config, name) == value
    callback_parser = ArgumentParser(exit_on_error=False)
    callback_parser.add_class_arguments(KBBQ, "kbbq")
    built = callback_parser.instantiate(callback_parser.parse_args(
        cli_args("kbbq.config", name, value))).kbbq
    assert isinstance(built, KBBQ) and built.config == from_cli

    # torchao's KBBQConfig: the recipe, or a refusal that names the field and quantize_model
    if name in PIPELINE_ONLY:
        with pytest.raises(ValueError, match=rf"{name}.*quantize_model"):
            KBBQConfig(from_cli, step="prepare")
    else:
        assert value_at(KBBQConfig(from_cli, step="prepare").config, name) == value


def test_defaults_and_python_spelling():
    config = QuantizationConfig()
    assert config.label == "RTN-KBBQ nvfp4, lambda 0.75"
    assert KBBQ().config == config == KBBQConfig(step="convert").config
    assert QuantizationConfig.from_dict(config.to_dict()) == config
    json.dumps(config.to_dict())  # JSON-ready
    with pytest.raises(TypeError, match=r"format must be a FormatConfig \(e\.g\. format="):
        QuantizationConfig(format="nvfp4")  # type: ignore[arg-type]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.transform.lam = 0.5  # type: ignore[misc]
    assert dataclasses.replace(config, transform=TransformConfig("kbbq", lam=0.5)).label == \
        "RTN-KBBQ nvfp4, lambda 0.5"
    # patterns as a tuple or one string are held as the list a recipe file gives
    layers = QuantizationConfig(layers=LayersConfig(targets=("mlp",), ignore="lm_head"))
    assert layers.layers == LayersConfig(targets=["mlp"], ignore=["lm_head"])
    assert QuantizationConfig.from_dict(layers.to_dict()) == layers
    with pytest.raises(ValueError, match=r"layers.targets holds module-name patterns"):
        LayersConfig(targets=[1])  # type: ignore[list-item]


def test_a_packaged_recipe_or_recipe_file_by_name(tmp_path):
    """``QuantizationConfig.from_recipe`` reads what ``kbbq-pl quantize --config`` reads (a
    packaged recipe's name or a recipe file), for the ``KBBQ`` callback and torchao's
    ``KBBQConfig`` in Python."""
    parser = _parser("kbbq-pl quantize")
    recipes = ROOT / "recipes"
    for name, path in (("gptq_kbbq_mxfp4", recipes / "gptq_kbbq_mxfp4.yaml"),
                       ("rtn_kbbq_nvfp4_lam0.5.yaml", recipes / "rtn_kbbq_nvfp4_lam0.5.yaml"),
                       (str(recipes / "i_nvfp4.yaml"), recipes / "i_nvfp4.yaml")):
        expected = parser.instantiate(parser.parse_args(["--config", str(path)])).recipe
        assert QuantizationConfig.from_recipe(name) == expected
    recipe = QuantizationConfig.from_recipe("rtn_kbbq_mxfp4_lam0.25")
    assert (recipe.format.name, recipe.transform.lam) == ("mxfp4", 0.25)
    assert KBBQ(recipe).config == KBBQConfig(recipe, step="prepare").config == recipe
    assert KBBQConfig("rtn_kbbq_mxfp4_lam0.25", step="prepare").config == recipe
    with pytest.raises(TypeError, match=r"KBBQConfig takes a recipe: a QuantizationConfig, or a "
                                        r"packaged recipe's name or a recipe file, got 4"):
        KBBQConfig(4, step="prepare")  # type: ignore[arg-type]
    with pytest.raises(FileNotFoundError, match=r"recipe 'rtn_kbbq_nvfp4_lam0.57': no such "
                                                r"file .* did you mean .*rtn_kbbq_nvfp4_lam0.75"):
        QuantizationConfig.from_recipe("rtn_kbbq_nvfp4_lam0.57")
    no_recipe = tmp_path / "model_only.yaml"
    no_recipe.write_text("model: minilm\n")
    with pytest.raises(ValueError, match="holds its recipe under 'recipe:'"):
        QuantizationConfig.from_recipe(no_recipe)


def test_the_callback_takes_a_recipe_by_name_in_python_and_in_a_lightningcli_yaml(tmp_path):
    """``KBBQ(config=...)`` takes the recipe, or a packaged recipe's name or a recipe file as
    ``kbbq-pl quantize --config`` does: in Python and in a LightningCLI config, where the
    recipe's fields as a mapping work as before."""
    from lightning.pytorch import LightningModule
    from lightning.pytorch.cli import LightningCLI

    recipes = ROOT / "recipes"
    gptq_mx = QuantizationConfig.from_recipe("gptq_kbbq_mxfp4")
    assert gptq_mx != QuantizationConfig()
    assert KBBQ("gptq_kbbq_mxfp4").config == KBBQ(recipes / "gptq_kbbq_mxfp4.yaml").config == \
        KBBQ(str(recipes / "gptq_kbbq_mxfp4.yaml")).config == gptq_mx
    with pytest.raises(TypeError, match=r"KBBQ takes a recipe: a QuantizationConfig, or a "
                                        r"packaged recipe's name or a recipe file, got 4"):
        KBBQ(4)  # type: ignore[arg-type]
    with pytest.raises(FileNotFoundError, match=r"did you mean .*gptq_kbbq_mxfp4"):
        KBBQ("gptq_kbbq_mxfp5")

    def callback(config: Any) -> KBBQ:
        settings = tmp_path / "fit.yaml"
        settings.write_text(yaml.safe_dump({"trainer": {
            "logger": False, "enable_checkpointing": False, "callbacks": [
                {"class_path": "kbbq_pl.callbacks.KBBQ",
                 "init_args": {"config": config, "calibrate_only": True}}]}}))
        cli = LightningCLI(LightningModule, run=False, save_config_callback=None,
                           args=["--config", str(settings)])
        found = [c for c in cli.trainer.callbacks if isinstance(c, KBBQ)]
        assert len(found) == 1 and found[0].calibrate_only
        return found[0]

    assert callback("gptq_kbbq_mxfp4").config == gptq_mx
    assert callback(str(recipes / "gptq_kbbq_mxfp4.yaml")).config == gptq_mx
    assert callback({"format": {"name": "mxfp4"}, "weights": {"quantizer": "gptq"}}).config == \
        gptq_mx


def test_unknown_and_removed_fields_are_one_line():
    with pytest.raises(ValueError, match=r"unknown recipe fields \['brake'\]"):
        QuantizationConfig.from_dict({"brake": 1})
    with pytest.raises(ValueError, match=r"\['transform.brake'\]"):
        QuantizationConfig.from_dict({"transform": {"brake": 1}})
    with pytest.raises(ValueError, match="autobrake.folds: lam: auto holds out one split"):
        QuantizationConfig.from_dict({"autobrake": {"folds": 4}})
    # the flat recipe of kbbq-pl before the groups (never released) is refused, and a
    # checkpoint that stores one is still described by its layers' format
    stored = json.loads((ROOT / "tests/data/v1/nvfp4_kbbq_static/quantization_config.json")
                        .read_text())["recipe"]
    with pytest.raises(ValueError, match="unknown recipe fields"):
        QuantizationConfig.from_dict(stored)

    from kbbq_pl.io.models import describe_quantized, quantized_checkpoint

    metadata = quantized_checkpoint(ROOT / "tests/data/v1/nvfp4_kbbq_static")
    assert describe_quantized(metadata) == "nvfp4"


@pytest.mark.parametrize("argv", [["--recipe.autobrake.scope", "model"],
                                  ["--quantizer.init_args.lam", "0.5"]])
def test_removed_command_line_options_are_one_line(argv, capsys):
    assert main(["quantize", *argv]) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and error.startswith("kbbq-pl quantize: error:"), error
    assert argv[0].lstrip("-") in error or argv[0] in error, error


def test_a_recipe_file_with_a_removed_field_is_one_line(tmp_path, capsys):
    old = tmp_path / "old.yaml"
    old.write_text(yaml.safe_dump({"recipe": {"transform": {"lam": "auto"},
                                              "autobrake": {"scope": "best"}}}))
    assert main(["quantize", "--config", str(old), "--output_dir", str(tmp_path / "o")]) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "scope" in error, error
    assert not (tmp_path / "o").exists()
