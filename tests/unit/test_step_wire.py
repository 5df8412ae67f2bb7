"""A step's inputs on the wire (engine/parallel/step_wire.py): a TP driver sends each follower only the step's host ints and
their layout, and the rows to project; a rank that rebuilds the step from those alone computes what rank 0 does.

The replaying rank here is a second, whole (TP 1) copy of the model in this process with its own cache: it sees
nothing of rank 0 but the commands a follower process would read, so any input the wire leaves out (a slot, a block
table, a chunk's start, the sampled rows) makes its cache or its logits part from rank 0's."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from engine.parallel.step_wire import HostStep, StepLayout, pack, unpack


def test_unpack_cuts_each_section_where_the_layout_says() -> None:
    # two decodes in one group (tables 2 wide), one prefill chunk of 3 tokens from position 5, one table per chunk
    sections = [[7, 8, 9, 10, 11], [4, 9, 5, 6, 7], [36, 73, 45, 46, 47], [0, 4], [1, 2, 3, 4], [5, 10], [5, 6]]
    host = pack(sections, StepLayout(tuple(map(len, sections)), 2, ((0, 2, 2),), ((3, 5),)))
    assert host.ints.dtype == torch.int32 and host.ints.device.type == "cpu"
    ids, pos, meta, rows = unpack(host.ints, host)
    assert ids.dtype == torch.int64 and ids.tolist() == sections[0] and pos.tolist() == sections[1]
    assert meta.slot_mapping.tolist() == sections[2] and rows.tolist() == [0, 4] and meta.num_decodes == 2
    (a, b, tables, lens), = meta.decode_groups
    assert (a, b, tables.tolist(), lens.tolist()) == (0, 2, [[1, 2], [3, 4]], [5, 10])
    (n, start, table), = meta.prefills
    assert (n, start, table.tolist(), meta.prefill_varlen) == (3, 5, [5, 6], None)
    assert meta.host is host


def test_a_varlen_layout_reads_the_chunks_through_one_call() -> None:
    sections = [[1, 2, 3], [0, 1, 0], [8, 9, 16], [1, 2], [1, 0, 2, 0], [0, 2, 3], [0, 0]]
    host = pack(sections, StepLayout(tuple(map(len, sections)), 0, (), ((2, 0), (1, 0)), varlen_width=2))
    _, _, meta, _ = unpack(host.ints, host)
    assert meta.prefill_varlen is not None
    tables, cu, starts, longest = meta.prefill_varlen
    assert (tables.tolist(), cu.tolist(), starts.tolist(), longest) == ([[1, 0], [2, 0]], [0, 2, 3], [0, 0], 2)


def test_a_layout_that_does_not_fit_its_sections_is_refused() -> None:
    with pytest.raises(ValueError, match="expected 5"):
        StepLayout((1, 1, 1, 0), 0, (), ((1, 0),))  # a chunk without its table
    with pytest.raises(ValueError, match="differ from the layout"):
        pack([[1], [0], [3], [], [0]], StepLayout((1, 1, 1, 0, 2), 0, (), ((1, 0),)))


class ReplayRank:
    """A follower in this process: runs each command as engine/parallel/tp_follower.py does, on its own model and cache."""

    ships = False
    has_cache = True

    def __init__(self, folder: Path, layout: Any) -> None:
        from engine.models.model import DecoderModel
        from engine.models.model_config import load_model_config
        from engine.models.model_loader import load_state_dict

        cfg = load_model_config(folder)
        self.model = DecoderModel(cfg, load_state_dict(folder, torch.float32), torch.float32, 256)
        kv, _ = layout.allocate(torch.device("cpu"))
        self.caches = list(kv.unbind(0))
        self.hidden = torch.empty(0)
        self.logits: list[torch.Tensor] = []
        self.commands: list[tuple[Any, ...]] = []

    def send(self, *command: Any) -> None:
        self.commands.append(command)
        if command[0] == "forward":
            _, host, _, _ = command
            ids, pos, meta, _ = unpack(host.ints, host)
            self.hidden = self.model.forward(ids, pos, meta, self.caches)
        elif command[0] == "logits":
            self.logits.append(self.model.logits(self.hidden, command[1]))


def test_a_rank_rebuilds_every_step_from_the_wire_alone(tiny_checkpoint) -> None:
    from engine.parallel.tp_group import DriverModel

    folder = tiny_checkpoint("qwen2")
    rng = random.Random(5)
    prompts = [[rng.randint(3, 399) for _ in range(rng.randint(2, 60))] for _ in range(5)]
    with LLM(str(folder), dtype="float32", max_num_batched_tokens=32, block_size=8, num_kv_blocks=64,
             num_threads=1) as llm:
        runner = llm.engine.runner
        rank = ReplayRank(folder, runner.layout)
        driver_logits: list[torch.Tensor] = []

        class Driver(DriverModel):
            def logits(self, hidden: torch.Tensor, rows: Any = None, index: Any = None) -> torch.Tensor:
                out = super().logits(hidden, rows, index)
                driver_logits.append(out)
                return out

        runner.model = Driver(runner.model, rank)  # type: ignore[arg-type]
        params = [SamplingParams(max_tokens=6, temperature=0.0, prompt_logprobs=2 if i == 1 else None)
                  for i in range(len(prompts))]
        llm.generate(prompts, params)
    kinds = {c[0] for c in rank.commands}
    assert kinds == {"forward", "logits"}
    for command in rank.commands:  # nothing but host values: a rank on another device reads no tensor of rank 0's
        for value in command[1:]:
            if isinstance(value, HostStep):
                assert value.ints.device.type == "cpu"
            else:
                assert value is None or isinstance(value, (bool, slice, list)), type(value)
    assert any(isinstance(c[1], slice) for c in rank.commands if c[0] == "logits")  # the prompt's logprobs
    assert len(driver_logits) == len(rank.logits) > len(prompts)
    for ours, theirs in zip(driver_logits, rank.logits):
        assert torch.equal(ours, theirs)


def test_a_driver_names_the_rows_it_projects(tiny_checkpoint) -> None:
    from engine.parallel.tp_group import DriverModel

    folder = tiny_checkpoint("qwen2")
    rank = ReplayRank(folder, _layout(rank_heads=None, folder=folder))
    driver = DriverModel(rank.model, rank)
    with pytest.raises(ValueError, match="last forward's hidden states"):
        driver.logits(torch.zeros(1, rank.model.cfg.hidden_size))
    ids, pos, meta, _ = unpack(*_one_chunk())
    meta = type(meta)(**{**meta.__dict__, "host": None})
    with pytest.raises(ValueError, match="no host ints"):
        driver.forward(ids, pos, meta, rank.caches)


def _one_chunk() -> tuple[torch.Tensor, HostStep]:
    host = pack([[5, 6, 7], [0, 1, 2], [0, 1, 2], [2], [0]], StepLayout((3, 3, 3, 1, 1), 0, (), ((3, 0),)))
    return host.ints, host


def _layout(rank_heads: int | None, folder: Path) -> Any:
    from engine.kv.kv_memory import KVLayout
    from engine.models.model_config import load_model_config

    cfg = load_model_config(folder)
    return KVLayout(cfg.num_layers, 4, 8, rank_heads or cfg.cache_heads, cfg.cache_head_dim, "float32", False,
                    cfg.kv_layout)
