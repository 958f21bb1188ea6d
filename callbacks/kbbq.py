"""Lightning callbacks: calibration statistics, and KBBQ W4A4 quantization before training.

``KBBQ`` quantizes the model before the strategy configures optimizers and wraps it (the model is
unwrapped, with no optimizer yet), so that ``Trainer.fit`` trains (fine-tunes through FP4,
straight-through) the quantized model, and ``Trainer.validate`` / ``test`` / ``predict`` see it
too::

    recipe = QuantizationConfig(transform=TransformConfig("kbbq", lam=0.75))  # NVFP4
    trainer = Trainer(callbacks=[KBBQ(recipe)])
    trainer.fit(module, datamodule=dm)        # calibrate, fit transforms, swap, then train

Calibration runs the callback's own no-grad loop over a calibration dataloader (as Lightning's
``BatchSizeFinder`` runs its own loop; a nested ``trainer.validate`` inside ``fit`` would fail),
each rank over its share of the batches, with the statistics summed through
``trainer.strategy``.  The quantization config is saved in every Lightning checkpoint, and
resuming (``trainer.fit(..., ckpt_path=...)``) rebuilds the quantized layers before the
weights load, with no new calibration.  For ``LightningModule.load_from_checkpoint``, call
:func:`restore_quantized` from the module's ``on_load_checkpoint``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import Tensor, nn

try:
    from lightning.pytorch import Callback, LightningModule, Trainer
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
    from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
except ImportError:  # pragma: no cover - lightning is a dependency
    from pytorch_lightning import Callback, LightningModule, Trainer
    from pytorch_lightning.strategies import FSDPStrategy, ModelParallelStrategy
    from pytorch_lightning.strategies.launchers.multiprocessing import _MultiProcessingLauncher

from kbbq_pl.formats import DeferredChecks, QuantizedTensor, deferred_checks
from kbbq_pl.io.checkpoint import install_empty_layers, layer_metadata
from kbbq_pl.quant import QuantizationConfig, QuantizationReport, quantize_model
from kbbq_pl.quant.collectives import Collectives
from kbbq_pl.quant.layers import (
    FusedGroup,
    exclude_quantized_from_ddp_sync,
    freeze_layers,
    fused_trainable_groups,
    quantized_linears,
    share_fused_scales,
)
from kbbq_pl.quant.modules import find_linears
from kbbq_pl.quant.stats import StatisticsCollector, run_calibration
from kbbq_pl.quant.w4a4 import cache_decoded_weights

log = logging.getLogger(__name__)
CHECKPOINT_KEY = "kbbq"
DEFAULT_RECIPE = QuantizationConfig()  # frozen: one shared default is safe


def hf_model(pl_module: nn.Module, attr: str | None = "model") -> nn.Module:
    """The module calibration batches are fed to: ``pl_module.<attr>`` (the usual place of a
    wrapped HuggingFace model), or ``pl_module`` itself where ``attr`` is None; a ValueError
    naming the module's submodules where it has no such attribute."""
    if attr is None:
        return pl_module
    try:
        model = pl_module.get_submodule(attr)  # a dotted path too: "backbone.lm"
    except AttributeError:
        model = None
    if model is None or model is pl_module:
        children = [name for name, _ in pl_module.named_children()]
        raise ValueError(f"KBBQ: {type(pl_module).__name__} has no submodule {attr!r} to "
                         f"quantize (model_attr={attr!r}); its submodules: {children}; pass "
                         "model_attr=NAME, or None for the LightningModule itself")
    return model


def calibration_batches(trainer: Trainer, source: Any, model: nn.Module | None = None
                        ) -> list[Mapping[str, Tensor]]:
    """This rank's share of the calibration batches for ``model``.

    ``source``: a dataloader or sequence of batches; else the trainer's datamodule's
    ``calibration_dataloader()`` (a :class:`~kbbq_pl.io.data.CalibrationDataModule`, its
    ``packing`` settled for ``model`` by ``for_model`` when one is given) or its
    ``train_dataloader()``.  Batches are dealt round-robin to the ranks.
    """
    if source is None:
        source = getattr(trainer, "datamodule", None)
        if source is None:
            raise ValueError("KBBQ needs calibration data: pass calibration= (a dataloader or a "
                             "CalibrationDataModule) or fit with a datamodule")
        if not hasattr(source, "calibration_dataloader"):
            try:
                source = source.train_dataloader()
            except Exception as error:  # noqa: BLE001 - named in the error below
                raise ValueError(
                    f"KBBQ calibrates on the datamodule's calibration_dataloader() or "
                    f"train_dataloader(); {type(source).__name__} has the first not and the "
                    f"second failed ({type(error).__name__}: {error}); pass calibration= (a "
                    "dataloader or a CalibrationDataModule)") from error
    if model is not None and hasattr(source, "for_model"):
        source.for_model(model)
    if hasattr(source, "calibration_dataloader"):
        source = source.calibration_dataloader()
    batches = list(source)
    if not batches:
        raise ValueError("the calibration set is empty: no batches")
    if not all(isinstance(batch, Mapping) and "input_ids" in batch for batch in batches):
        first = batches[0]
        raise ValueError("KBBQ calibrates on dict batches with input_ids (the model's keyword "
                         f"arguments), got {type(first).__name__}"
                         f"{' with keys ' + str(list(first)) if isinstance(first, Mapping) else ''}"
                         "; pass calibration= (a CalibrationDataModule or dict batches) or "
                         "give the datamodule a calibration_dataloader()")
    rank, world = trainer.global_rank, trainer.world_size
    if world > 1 and len(batches) < world:
        raise ValueError(f"{len(batches)} calibration batches for {world} ranks")
    return batches[rank::world]


class CalibrationStatistics(Callback):
    """Collect per-layer input statistics (:mod:`kbbq_pl.quant.stats`) in ``setup``.

    After ``setup`` the statistics are in ``self.collector.stats`` (layer name -> sums),
    identical on every rank.
    """

    def __init__(
        self,
        block: int = 16,
        targets: Sequence[str] | None = None,
        ignore: Sequence[str] | None = None,
        calibration: Any = None,
        model_attr: str | None = "model",
        keep_samples: int = 0,
        full: bool = False,
    ) -> None:
        self.block = block
        self.targets = targets
        self.ignore = ignore
        self.calibration = calibration
        self.model_attr = model_attr
        self.keep_samples = keep_samples
        self.full = full
        self.collector: StatisticsCollector | None = None

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.collector is not None:
            return
        model = hf_model(pl_module, self.model_attr)
        model.to(trainer.strategy.root_device)
        modules = find_linears(model, self.targets, self.ignore)
        collector = StatisticsCollector(modules, self.block, self.keep_samples, full=self.full)
        with collector.hooks():
            run_calibration(model, calibration_batches(trainer, self.calibration, model))
        collector.reduce(Collectives.lightning(trainer.strategy).reduce_sum)
        collector.check_nonempty()
        self.collector = collector


class KBBQ(Callback):
    """Quantize the model to W4A4 with a KBBQ-family recipe before training sees it.

    ``weights.quantizer: gptq`` splits GPTQ's work across the trainer's ranks.  In a
    LightningCLI config::

        trainer:
          callbacks:
            - class_path: kbbq_pl.callbacks.KBBQ
              init_args:
                config: gptq_kbbq_nvfp4   # or the fields: {format: {name: mxfp4}, ...}

    Args:
        config: the recipe: a :class:`~kbbq_pl.quant.config.QuantizationConfig` (whose
            groups describe each field), or a packaged recipe's name or a recipe file, read by
            :meth:`~kbbq_pl.quant.config.QuantizationConfig.from_recipe`; default: RTN-KBBQ
            NVFP4, lambda 0.75.
        calibration: calibration batches (a dataloader, a ``CalibrationDataModule`` or a list of
            dicts); default: the trainer's datamodule.
        model_attr: attribute of the LightningModule holding the HuggingFace model (None:
            the LightningModule itself).
        calibrate_only: quantize, then end ``fit`` before the first step (post-training
            quantization through ``Trainer.fit``; ``Trainer.validate`` quantizes too).
        trainable: keep high-precision master weights that fine-tuning updates through
            straight-through rounding (default: during ``fit`` unless ``calibrate_only``);
            they are rounded into stored codes at the end of ``fit``.  A layer whose weight
            does not require grad (frozen, as under peft's adapters, which stay in full
            precision) stores codes and stays frozen.  GPTQ's codes are
            final: with ``weights.quantizer: gptq`` the default is False.
        offload: quantize with the model on the CPU, one block at a time on the trainer's
            device, then move the quantized model there (a model whose full-precision weights
            do not fit on the device, whose FP4 weights do).
    """

    def __init__(
        self,
        config: QuantizationConfig | str | Path = DEFAULT_RECIPE,
        *,
        calibration: Any = None,
        model_attr: str | None = "model",
        calibrate_only: bool = False,
        trainable: bool | None = None,
        offload: bool = False,
    ) -> None:
        self.config = QuantizationConfig.resolve(config, "KBBQ")
        self.calibration = calibration
        self.model_attr = model_attr
        self.calibrate_only = calibrate_only
        self.trainable = trainable
        self.offload = offload
        self.report: QuantizationReport | None = None
        self._checks: DeferredChecks | None = None
        self._checks_scope: contextlib.ExitStack | None = None
        self._fused: list[FusedGroup] = []  # trainable layers sharing an NVFP4 scale
        self._left_frozen = False  # quantized for training, every layer frozen by the user

    # ------------------------------------------------------------------ Lightning hooks

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        refuse_sharding_strategy(trainer.strategy)
        if stage == "fit" and not quantized_linears(pl_module):
            refuse_spawned_fit(trainer.strategy)
        # Lightning restores a checkpoint (fit/validate(ckpt_path=...)) after every setup hook
        # and before strategy.setup configures optimizers and wraps the model, and it tells
        # callbacks nothing in between.  So the model is quantized at the start of
        # strategy.setup, unless it already is or the restore (which goes through
        # load_model_state_dict) has rebuilt the quantized layers from the checkpoint, as the
        # checkpoint holds them (master weights or codes): no calibration is repeated.
        strategy = trainer.strategy
        for method in ("setup", "load_model_state_dict", "load_optimizer_state_dict"):
            strategy.__dict__.pop(method, None)  # left by a run that failed before setup
        load_state, setup_strategy = strategy.load_model_state_dict, strategy.setup

        def load_model_state_dict(checkpoint, *args, **kwargs):
            if restore_quantized(pl_module, checkpoint):
                log.info("KBBQ: rebuilt the quantized layers from the checkpoint")
            self._take_checkpoint_recipe(checkpoint.get(CHECKPOINT_KEY))
            loaded = load_state(checkpoint, *args, **kwargs)
            if stage != "fit":  # evaluated as fit leaves a model: on its stored codes
                freeze_layers(quantized_linears(pl_module))
            return loaded

        def setup_then_restore_methods(trainer_: Trainer) -> None:
            del strategy.load_model_state_dict, strategy.setup
            if not quantized_linears(pl_module):
                self._quantize_in_trainer(trainer, pl_module, stage)
            exclude_quantized_from_ddp_sync(pl_module)
            setup_strategy(trainer_)
            if stage == "fit":  # the optimizers exist now; a checkpoint's state loads next
                load_optimizers = strategy.load_optimizer_state_dict

                def load_optimizer_state_dict(checkpoint):
                    del strategy.load_optimizer_state_dict
                    states = checkpoint.get("optimizer_states") or []
                    if CHECKPOINT_KEY not in checkpoint:  # saved before any quantization
                        states = _without_master_weight_states(strategy.optimizers, states,
                                                               pl_module)
                    adapted = [optimizer_state_for(optimizer, state) for optimizer, state
                               in zip(strategy.optimizers, states)]
                    return load_optimizers({**checkpoint, "optimizer_states": [
                        *adapted, *states[len(adapted):]]})

                strategy.load_optimizer_state_dict = load_optimizer_state_dict

        strategy.load_model_state_dict = load_model_state_dict
        strategy.setup = setup_then_restore_methods

    def _take_checkpoint_recipe(self, state: Mapping[str, Any] | None) -> None:
        """Resume as the checkpoint's layers were quantized: its recipe (recorded again in the
        checkpoints saved from now on; a different one given to the callback is named in a
        warning) and whether the user had frozen every layer (no decoded copy, no warning)."""
        if state is None:
            return
        self._left_frozen = bool(state.get("frozen_by_user", False))
        try:
            saved = QuantizationConfig.from_dict(state["config"])
        except (TypeError, ValueError) as error:  # fields an earlier kbbq-pl wrote
            log.warning("KBBQ: the checkpoint's recipe does not read as a recipe of this "
                        "kbbq-pl (%s): its layers resume as they are, under the callback's "
                        "recipe", error)
            return
        if saved != self.config:
            differences = _recipe_differences(saved.to_dict(), self.config.to_dict())
            log.warning("KBBQ: the checkpoint's layers were quantized with another recipe than "
                        "the callback's (%s): they resume as they are, under the checkpoint's",
                        "; ".join(differences))
            self.config = saved

    def _warn_if_frozen(self, pl_module: LightningModule) -> None:
        layers = quantized_linears(pl_module).values()
        if not self.calibrate_only and self.trainable is not False and not self._left_frozen \
                and layers and not any(layer.trainable for layer in layers):
            log.warning("KBBQ: the quantized layers hold stored codes (the end of an earlier "
                        "fit, GPTQ, or a checkpoint saved after either): they stay as they are "
                        "and only the rest of the model trains")

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # the quantized layers exist now (strategy.setup); their transforms do not train
        self._warn_if_frozen(pl_module)
        self._fused = fused_trainable_groups(quantized_linears(pl_module))

    def _quantize_in_trainer(self, trainer: Trainer, pl_module: LightningModule,
                             stage: str) -> None:
        model = hf_model(pl_module, self.model_attr)
        device = trainer.strategy.root_device
        model.to("cpu" if self.offload else device)
        batches = calibration_batches(trainer, self.calibration, model)
        trainable = self.trainable if self.trainable is not None else (
            stage == "fit" and not self.calibrate_only and self.config.weights.quantizer == "rtn")
        self.report = quantize_model(model, batches, self.config, trainable=trainable,
                                     progress=trainer.is_global_zero, device=device,
                                     collectives=Collectives.lightning(trainer.strategy))
        model.to(device)
        # weights that did not require grad (frozen by the user, as under peft's adapters)
        # became stored codes, frozen as they were: nothing to warn of
        self._left_frozen = trainable and not any(
            layer.trainable for layer in quantized_linears(model).values())

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        trainer.strategy.__dict__.pop("load_optimizer_state_dict", None)  # no checkpoint
        if self.calibrate_only:
            # should_stop waits for min_epochs / min_steps: nothing trains after calibration
            trainer.fit_loop.min_epochs = 0
            trainer.fit_loop.epoch_loop.min_steps = 0
            trainer.should_stop = True
            return
        # the rounding's NaN/Inf checks stay on the device: one host synchronization per
        # optimizer step instead of two or three per layer per forward (formats.DeferredChecks)
        _warn_if_not_optimized(trainer, pl_module)
        share_fused_scales(self._fused)
        self._checks_scope = contextlib.ExitStack()
        self._checks = self._checks_scope.enter_context(deferred_checks())
        if not self._left_frozen and any(
                not layer.trainable for layer in quantized_linears(pl_module).values()):
            # stored codes (GPTQ) do not change while the rest trains: decode each once, not in
            # every forward (4 bytes per weight element, as a trainable master weight holds);
            # not where the user froze the layers (QLoRA), which holds no dense copy
            self._checks_scope.enter_context(cache_decoded_weights())

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        share_fused_scales(self._fused)

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule,
                                 optimizer: Any) -> None:
        if self._checks is not None:
            self._checks.check()  # before a NaN reaches the weights

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        if self._checks is not None:
            self._checks.check()  # steps without an optimizer step (accumulation, manual)
        # the master weights moved: the fused layers' shared NVFP4 scale follows them before
        # the next batch and before a checkpoint (ModelCheckpoint's hooks run after this one)
        share_fused_scales(self._fused)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._close_checks()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule,
                     exception: BaseException) -> None:
        self._close_checks(exception)

    def _close_checks(self, exception: BaseException | None = None) -> None:
        scope, self._checks_scope, self._checks = self._checks_scope, None, None
        if scope is not None:
            if exception is None:
                scope.close()  # checks what is left
            else:
                scope.__exit__(type(exception), exception, exception.__traceback__)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        freeze_layers(quantized_linears(pl_module))
        self._fused = []  # no master weights left to share a scale
        # the optimizers (and a checkpoint saved from now on) keep only what still trains
        live = {id(p) for p in pl_module.parameters()}
        for optimizer in trainer.optimizers:
            for group in optimizer.param_groups:
                for stale in [p for p in group["params"] if id(p) not in live]:
                    optimizer.state.pop(stale, None)
                group["params"] = [p for p in group["params"] if id(p) in live]

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        layers = quantized_linears(pl_module)
        checkpoint[CHECKPOINT_KEY] = {
            "config": self.config.to_dict(),
            "layers": {name: layer_metadata(layer) for name, layer in layers.items()},
            "trainable": any(layer.trainable for layer in layers.values()),
            "frozen_by_user": self._left_frozen,
        }


def refuse_sharding_strategy(strategy: Any) -> None:
    """Refuse a strategy that shards the model's parameters across processes: FSDP,
    ``ModelParallelStrategy`` (FSDP2's ``fully_shard`` or tensor parallelism in
    ``configure_model``), DeepSpeed ZeRO-3.  KBBQ swaps its layers in after ``configure_model``
    (outside FSDP2's sharding, so each rank would train its master weights alone), FSDP
    flattens parameters (the stored codes are a tensor subclass) and the master weights are
    rounded whole at the end of ``fit``."""
    if isinstance(strategy, (FSDPStrategy, ModelParallelStrategy)) or getattr(
            strategy, "zero_stage_3", False):
        raise ValueError(
            f"KBBQ: {type(strategy).__name__} shards the model's parameters across processes, "
            "which KBBQ's quantized layers do not support: fine-tune under DDP "
            "(strategy='ddp', each process holding the whole model), and quantize a model too "
            "large for one device with KBBQ(offload=True) or `kbbq-pl quantize --stream`")


def refuse_spawned_fit(strategy: Any) -> None:
    """Refuse ``fit`` on a model not yet quantized under a launcher that trains in worker
    processes (``ddp_spawn``, ``ddp_fork``, ``ddp_notebook``): Lightning then loads the
    workers' weights into the main process's model, which no callback hook reaches, so it is
    still unquantized there and cannot take the stored codes (the run was lost at its end)."""
    if isinstance(getattr(strategy, "launcher", None), _MultiProcessingLauncher):
        raise ValueError(
            f"KBBQ: fit under {type(strategy).__name__} with start method "
            f"{strategy.launcher._start_method!r} (strategy='ddp_spawn', 'ddp_fork' or "
            "'ddp_notebook') trains in worker processes whose quantized weights Lightning "
            "loads back into the main process's model, which KBBQ does not reach: use "
            "strategy='ddp', or quantize the model before fit (kbbq_pl.quantize_model(..., "
            "trainable=True))")


def restore_quantized(pl_module: nn.Module, checkpoint: Mapping[str, Any]) -> bool:
    """Rebuild the quantized layers a checkpoint holds, so its weights load into them (where
    the module has none, or holds them otherwise: stored codes after ``fit`` and a checkpoint
    of master weights saved during it, or the reverse); whether it rebuilt them.  Call it from
    ``LightningModule.on_load_checkpoint`` to use ``load_from_checkpoint``."""
    state = checkpoint.get(CHECKPOINT_KEY)
    layers = quantized_linears(pl_module)
    if layers and (state is None or (set(layers) == set(state["layers"]) and any(
            layer.trainable for layer in layers.values()) == state["trainable"])):
        return False
    stored = checkpoint.get("state_dict", {})
    if state is None:
        codes = [name.rpartition(".")[0] for name, value in stored.items()
                 if isinstance(value, QuantizedTensor)
                 or name.endswith((".transform", ".act_global_scale"))]
        if codes:
            raise ValueError(
                f"this checkpoint holds quantized layers ({codes[0]}, ...) but not KBBQ's "
                f"'{CHECKPOINT_KEY}' entry that describes them: it was saved with "
                "weights_only (ModelCheckpoint(save_weights_only=True) skips callbacks' "
                "state); save full checkpoints, or the model with kbbq_pl.save_quantized")
        return False
    install_empty_layers(pl_module, state["layers"], trainable=state["trainable"],
                         stored=stored)
    return True


def optimizer_state_for(optimizer: Any, saved: dict[str, Any]) -> dict[str, Any]:
    """``saved`` (an optimizer's state dict from a checkpoint written after ``fit``, which holds
    only the parameters that train) as ``optimizer`` loads it where its groups also list the
    stored codes of the quantized layers (``configure_optimizers`` over every parameter): each
    group's saved parameters in order, the codes given ids without state; else as saved."""
    groups = saved.get("param_groups", [])
    if len(groups) != len(optimizer.param_groups):
        return saved
    ids = (i for group in groups for i in group["params"])
    fresh = max([-1, *(i for group in groups for i in group["params"])]) + 1
    adapted = []
    for group, current in zip(groups, optimizer.param_groups):
        codes = [isinstance(p, QuantizedTensor) for p in current["params"]]
        if len(group["params"]) != codes.count(False):
            return saved
        params = []
        for is_codes in codes:
            params.append(fresh if is_codes else next(ids))
            fresh += is_codes
        adapted.append({**group, "params": params})
    return {**saved, "param_groups": adapted}


def _without_master_weight_states(optimizers: Sequence[Any], states: list[dict[str, Any]],
                                  pl_module: nn.Module) -> list[dict[str, Any]]:
    """``states`` (optimizer state dicts saved before quantization) less the state of the
    parameters that are trainable quantized layers' master weights now: it was ``W``'s, and
    they train ``W T^-1``; they start afresh, with a warning."""
    masters = {id(layer.weight) for layer in quantized_linears(pl_module).values()
               if layer.trainable}
    dropped, kept = 0, []
    for optimizer, saved in zip(optimizers, states):
        drop = {saved_id for group, current in zip(saved.get("param_groups", []),
                                                   optimizer.param_groups)
                for saved_id, param in zip(group["params"], current["params"])
                if id(param) in masters and saved_id in saved.get("state", {})}
        dropped += len(drop)
        kept.append({**saved, "state": {k: v for k, v in saved.get("state", {}).items()
                                        if k not in drop}} if drop else saved)
    if dropped:
        log.warning("KBBQ: the checkpoint was saved before quantization: the optimizer state of "
                    "%d quantized layers' weights (of W, where the layers train W T^-1) is "
                    "dropped; they start afresh", dropped)
    return kept + states[len(kept):]


def _recipe_differences(saved: Mapping[str, Any], given: Mapping[str, Any],
                        prefix: str = "") -> list[str]:
    """The recipe fields in which ``saved`` (the checkpoint's) and ``given`` (the callback's)
    differ, as ``"field: saved, not given"``."""
    differences = []
    for name in saved.keys() | given.keys():
        ours, theirs = saved.get(name), given.get(name)
        if isinstance(ours, Mapping) and isinstance(theirs, Mapping):
            differences += _recipe_differences(ours, theirs, f"{prefix}{name}.")
        elif ours != theirs:
            differences.append(f"{prefix}{name}: {ours}, not {theirs}")
    return sorted(differences)


def _warn_if_not_optimized(trainer: Trainer, pl_module: nn.Module) -> None:
    """Warn where a trainable quantized layer's master weight is in no optimizer's parameter
    groups (grouped by module type, a ``QuantizedLinear`` is not an ``nn.Linear``): ``fit``
    would round it unchanged."""
    optimized = {id(p) for optimizer in trainer.optimizers for group in optimizer.param_groups
                 for p in group["params"]}
    missing = [name for name, layer in quantized_linears(pl_module).items()
               if layer.trainable and id(layer.weight) not in optimized]
    if missing and trainer.optimizers:
        log.warning(f"KBBQ: {len(missing)} trainable quantized layers ({missing[0]}, ...) have "
                    "their master weight in no optimizer parameter group, so fit leaves them "
                    "as quantized; include them in configure_optimizers (self.parameters(), "
                    "or by name, or by module type: a QuantizedLinear is an nn.Linear)")


__all__ = ["CalibrationStatistics", "KBBQ", "calibration_batches", "refuse_sharding_strategy",
           "refuse_spawned_fit", "restore_quantized"]
