"""Hugging Face's `Trainer` training a Rockmate as it trains the model itself.

A trainer reads the model as well as calling it: the dataset columns its `forward` names, its
labels, its loss type (the tokens a causal LM's loss averages over), its config. The Rockmate,
given no sample, plans at the trainer's first batch (which carries `num_items_in_batch`); the
losses, the evaluation loss and the trained weights are eager's, and each training step's
measured peak is within the budget where the loss is computed inside the model.
"""

from __future__ import annotations

import copy
import inspect
import warnings

import pytest
import torch

from rockplan import Rockmate
from rockplan.memory import MemoryTracker

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # the Trainer's own requirement

VOCAB, SEQ = 128, 16


def _gpt2() -> torch.nn.Module:
    # dropout 0.1 (GPT-2's default): the planned step must draw eager's masks
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=64,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


class _Texts(torch.utils.data.Dataset):
    """Token ids with their labels, and a column no model takes (the trainer drops it)."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, object]:
        ids = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone(), "source": f"document {i}"}


def _train(model: torch.nn.Module, out: str, **arguments: object) -> tuple[list[float], float, list[int], list[str]]:
    """Four steps and an evaluation: the logged losses, the evaluation loss, the measured peak
    of each training step after the first (the first plans, under the allocator's events
    itself), and the warnings. `arguments`: more of the `TrainingArguments`."""
    args = transformers.TrainingArguments(
        output_dir=out, per_device_train_batch_size=4, max_steps=4, logging_steps=1, use_cpu=True, seed=0,
        report_to=[], save_strategy="no", dataloader_num_workers=0, disable_tqdm=True, **arguments)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Texts(), eval_dataset=_Texts())
    training_step, peaks = trainer.training_step, []

    def measured_step(*args: object, **kwargs: object) -> torch.Tensor:
        if trainer.state.global_step == 0:
            return training_step(*args, **kwargs)
        with MemoryTracker(torch.device("cpu")) as tracker:
            loss = training_step(*args, **kwargs)
        peaks.append(tracker.peak)
        return loss

    trainer.training_step = measured_step
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return losses, trainer.evaluate()["eval_loss"], peaks, [str(w.message) for w in caught]


SETUPS = {"fp32": {}, "bf16": {"bf16": True}, "label smoothing": {"label_smoothing_factor": 0.1}}


@pytest.mark.parametrize("setup", SETUPS)
def test_trainer_trains_a_rockmate_as_it_trains_the_model(setup: str, tmp_path: object) -> None:
    """bf16: the trainer's autocast (accelerate's mixed precision) around the Rockmate's forward.
    Label smoothing: the trainer takes the labels out of the batch and computes the loss from
    the logits, shifting the labels by the model's kind, which it reads off its name."""
    torch.manual_seed(0)
    model = _gpt2()
    eager = copy.deepcopy(model)
    rk = Rockmate(model, budget=0.6, profile="estimate", plan_cache=False)
    eager_losses, eager_eval, eager_peaks, _ = _train(eager, str(tmp_path / "eager"), **SETUPS[setup])
    losses, evaluated, peaks, warned = _train(rk, str(tmp_path / "planned"), **SETUPS[setup])
    assert len(losses) == 4 and len(peaks) == 3
    tolerance = {"rtol": 1e-3 if setup == "bf16" else 1e-6, "atol": 0}
    torch.testing.assert_close(losses, eager_losses, **tolerance)
    torch.testing.assert_close(evaluated, eager_eval, **tolerance)
    if setup != "bf16":  # (in bf16, AdamW turns rounding-sized gradient differences into lr-sized steps)
        for p, q in zip(eager.parameters(), model.parameters()):
            torch.testing.assert_close(q, p)
    assert not [w for w in warned if "planned" in w]  # the first batch planned, and nothing after
    plan = rk.plan
    assert plan.schedule.predicted_peak <= plan.budget < plan.reference.predicted_peak
    assert max(peaks) < min(eager_peaks)  # the trainer's whole step, measured
    if "label_smoothing_factor" not in SETUPS[setup]:  # (else the loss's log-softmax is outside the plan)
        assert max(peaks) <= plan.budget


def test_a_rockmate_reads_as_its_model() -> None:
    """What trainers read of a model, read of its Rockmate: `forward`'s signature (instance and
    class), attributes, the state dict's keys; pickled, it stays its model's class."""
    model = _gpt2()
    rk = Rockmate(model, budget=0.6)
    assert isinstance(rk, Rockmate) and type(rk).__name__ == "Rockmate[GPT2LMHeadModel]"
    assert inspect.signature(rk.forward) == inspect.signature(model.forward)
    assert inspect.signature(type(rk).forward) == inspect.signature(type(model).forward)
    assert transformers.utils.find_labels(type(rk)) == ["labels"]
    assert rk.config is model.config and rk.loss_type == model.loss_type
    assert rk.state_dict().keys() == model.state_dict().keys() and rk._get_name() == "GPT2LMHeadModel"
    assert repr(rk).startswith("Rockmate[GPT2LMHeadModel](\n  (model): GPT2LMHeadModel(")
    with pytest.raises(AttributeError, match="no_such_attribute"):
        _ = rk.no_such_attribute
    assert type(copy.deepcopy(rk)) is type(rk)


@pytest.mark.parametrize("setup", ["fp32", "label smoothing"])
def test_trainer_trains_a_lora_model_in_a_rockmate(setup: str, tmp_path: object) -> None:
    """LoRA as PEFT applies it (a Llama whose query and value projections take adapters, the
    base frozen): the Rockmate wraps the PEFT model and trains as it does, within the budget.
    Label smoothing: the trainer shifts the labels by the name of the model PEFT adapts."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.1,
                           task_type="CAUSAL_LM")
    model = peft.get_peft_model(transformers.LlamaForCausalLM(config), lora)
    eager = copy.deepcopy(model)
    rk = Rockmate(model, budget=0.6, profile="estimate", plan_cache=False)
    assert type(rk).__name__ == "Rockmate[PeftModelForCausalLM]"
    eager_losses, eager_eval, eager_peaks, _ = _train(eager, str(tmp_path / "eager"), **SETUPS[setup])
    losses, evaluated, peaks, _ = _train(rk, str(tmp_path / "planned"), **SETUPS[setup])
    torch.testing.assert_close(losses, eager_losses, rtol=1e-6, atol=0)
    torch.testing.assert_close(evaluated, eager_eval, rtol=1e-6, atol=0)
    for (name, p), q in zip(eager.named_parameters(), model.parameters()):
        assert q.requires_grad == p.requires_grad == ("lora_" in name)
        torch.testing.assert_close(q, p)
    plan = rk.plan
    assert plan.schedule.predicted_peak <= plan.budget < plan.reference.predicted_peak
    assert max(peaks) < min(eager_peaks)
    if setup == "fp32":
        assert max(peaks) <= plan.budget
