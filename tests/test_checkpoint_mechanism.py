"""The mechanism apart from any policy's bytes: state dicts, removal, eval and no_grad, the model's ignorance of
checkpointing, block discovery, and the policy grammar's errors and fuzz (moved from test_activation_checkpoint.py,
issue 47: files under 400 lines)."""

import copy

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

import fitgpt.activation_checkpoint.apply as apply_mod
from fitgpt.activation_checkpoint import (
    ActivationCheckpointWrapper,
    applied_policy,
    apply_activation_checkpointing,
    find_blocks,
    parse_policy,
    remove_activation_checkpointing,
)
from fitgpt.errors import UserError
from fitgpt.model import Transformer

# ---- the mechanism --------------------------------------------------------------------------------


def test_state_dict_keys_unchanged_and_loadable_both_ways(tiny_model_config):
    cfg = tiny_model_config()
    plain = Transformer(cfg)
    wrapped = copy.deepcopy(plain)
    apply_activation_checkpointing(wrapped, "group:2+chunked-loss:8")
    assert list(wrapped.state_dict()) == list(plain.state_dict())
    fresh_plain, fresh_wrapped = Transformer(cfg), Transformer(cfg)
    apply_activation_checkpointing(fresh_wrapped, "block")
    fresh_plain.load_state_dict(wrapped.state_dict())
    fresh_wrapped.load_state_dict(plain.state_dict())
    idx = torch.randint(0, cfg.vocab_size, (2, 16))
    with torch.no_grad():
        assert torch.equal(fresh_plain(idx)[0], plain(idx)[0])
        assert torch.equal(fresh_wrapped(idx)[0], plain(idx)[0])


def test_remove_restores_the_module_tree_and_outputs(tiny_model_config):
    cfg = tiny_model_config()
    model = Transformer(cfg)
    before = repr(model)
    blocks = list(model.attn_blocks)
    head = model.lm_head
    idx = torch.randint(0, cfg.vocab_size, (2, 16))
    ref = model(idx)[0]
    apply_activation_checkpointing(model, "group:3+chunked-loss")
    assert isinstance(model.attn_blocks[0], ActivationCheckpointWrapper) and repr(model) != before
    assert applied_policy(model).spec == "group:3+chunked-loss"
    remove_activation_checkpointing(model)
    assert repr(model) == before and list(model.attn_blocks) == blocks and model.lm_head is head
    assert torch.equal(model(idx)[0], ref)
    assert applied_policy(model).is_none


def test_no_recompute_wrapper_runs_in_eval_or_no_grad(monkeypatch, tiny_model_config):
    calls = []
    real = apply_mod.checkpoint
    monkeypatch.setattr(apply_mod, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k))
    cfg = tiny_model_config()
    model = Transformer(cfg)
    apply_activation_checkpointing(model, "block+chunked-loss:8")
    idx = torch.randint(0, cfg.vocab_size, (2, 32))
    with torch.no_grad():
        model(idx, idx)
    model.eval()
    model(idx, idx)[1].backward()
    model.generate(idx[:, :4], 3)
    assert calls == []
    model.train()
    model(idx, idx)
    assert len(calls) == cfg.n_blocks + 64 // 8  # one per block and one per loss chunk


def test_the_model_knows_nothing_of_checkpointing_and_method_1_is_one_call(tiny_model_config):
    model = Transformer(tiny_model_config())
    assert not any(isinstance(b, ActivationCheckpointWrapper) for b in model.attn_blocks)
    apply_activation_checkpointing(model, "every:2")  # the seed's Method 1, from outside the model
    assert [isinstance(b, ActivationCheckpointWrapper) for b in model.attn_blocks] == [True, False, True, False]
    assert applied_policy(model).spec == "every:2"


def test_chunked_loss_returns_no_logits_with_targets_but_logits_without(tiny_model_config):
    cfg = tiny_model_config()
    model = Transformer(cfg)
    apply_activation_checkpointing(model, "chunked-loss:10")
    idx = torch.randint(0, cfg.vocab_size, (2, 32))
    logits, loss = model(idx, idx)
    assert logits is None and loss.ndim == 0
    logits, loss = model(idx)
    assert logits.shape == (2, 32, cfg.vocab_size) and loss is None


def test_find_blocks_knows_paths_and_falls_back_to_longest_modulelist(tiny_model_config):
    class Other(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.ModuleList([nn.Linear(4, 4), nn.ReLU()])
            self.trunk = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])

        def forward(self, x):
            for m in self.trunk:
                x = m(x)
            return x

    assert find_blocks(Transformer(tiny_model_config()))[0] == "attn_blocks"
    assert find_blocks(Other())[0] == "trunk"
    assert find_blocks(Other(), "stem")[0] == "stem"
    with pytest.raises(ValueError, match="does not name an nn.ModuleList"):
        find_blocks(Other(), "nope")


@pytest.mark.parametrize(
    "spec, match",
    [("block+selective", "same blocks"), ("none+block", "cannot be combined"), ("group:0", "at least 1"),
     ("every:x", "not an integer"), ("blocks:", "at least one block id"), ("block+every:2", "more than one"),
     ("blocks:1,1", "repeated"), ("wat", "unknown checkpointing term"), ("", "empty"),
     ("blocks:0,1+selective:1", r"\[1\] are both"), ("selective+pointwise", "same blocks"),
     ("pointwise:2+blocks:2", r"\[2\] are both block and pointwise"), ("selective:0+pointwise:0,1", r"\[0\] are both")],
)
def test_nonsense_policies_get_clear_errors(spec, match):
    with pytest.raises(UserError, match=match):
        parse_policy(spec)


def test_policy_errors_that_need_the_depth(tiny_model_config):
    model = Transformer(tiny_model_config(n_blocks=4))
    with pytest.raises(UserError, match="out of range"):
        apply_activation_checkpointing(model, "blocks:7")
    with pytest.raises(UserError, match="larger than the model's 4 blocks"):
        apply_activation_checkpointing(model, "group:5")
    with pytest.raises(UserError, match="whole groups"):
        apply_activation_checkpointing(model, "group:2+offload:1")
    with pytest.raises(UserError, match="covered by two"):
        apply_activation_checkpointing(model, "every:2+selective:2")


GRAMMAR = st.sampled_from(["block", "group", "every", "blocks", "sqrt", "selective", "pointwise", "torchtitan", "offload",
                           "chunked-loss", "none",
                           ":", ",", "+", "0", "3", "-1", "x", " "])


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(max_size=40), st.lists(GRAMMAR, max_size=8).map("".join)))
def test_policy_parser_fuzz(text):
    """Any string is a policy that round-trips through its spec, or a ValueError; never a crash."""
    try:
        policy = parse_policy(text)
    except UserError:
        return
    assert parse_policy(policy.spec) == policy
    for n in (1, 4, 12):
        try:
            policy.regions(n)
        except UserError:
            pass


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["block", "group:2", "every:3", "blocks:0,2", "sqrt", "selective", "selective:1",
                                 "pointwise", "pointwise:4", "torchtitan:2", "offload", "offload:3", "chunked-loss", "chunked-loss:5",
                                 "none"]),
                min_size=1, max_size=3))
def test_policy_combinations_fuzz(terms):
    spec = "+".join(terms)
    try:
        policy = parse_policy(spec)
        regions = policy.regions(6)
    except UserError:
        return
    covered = [i for r in regions for i in range(r.start, r.stop)]
    assert covered == list(range(6))
