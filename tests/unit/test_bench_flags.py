"""pdcluster bench's flags: bad values stop with an argparse error naming the flag, before any request."""

from __future__ import annotations

import pytest

from cluster.cli import build_parser, main


@pytest.mark.parametrize("argv, says", [
    (["--concurrency", "1,x"], "--concurrency"),
    (["--concurrency", "0"], "--concurrency"),
    (["--rate", "1,-2"], "--rate"),
    (["--concurrency", "1", "--rate", "2"], "not allowed with"),
    (["--concurrency", "2", "--max-concurrency", "2"], "--max-concurrency"),
    (["--endpoint", "embeddings"], "--endpoint"),
    (["--dataset", "sharegpt"], "--dataset"),
    (["--dataset", "shared-prefix"], "--prefix-len"),
    (["--turns", "3"], "--turns"),
    (["--input-len", "0"], "--input-len"),
    (["--output-range", "1.5"], "--output-range"),
    (["--burstiness", "0.5"], "--burstiness"),
    (["--slo-ttft", "0"], "--slo-ttft"),
    (["--num-requests", "0"], "--num-requests"),
    (["--url", "localhost:8000"], "--url"),
    (["--tokenizer", "/no/such/folder"], "--tokenizer"),
    (["--extra-body", "{bad"], "--extra-body"),
    (["--extra-body", "[1]"], "--extra-body"),
    (["--extra-body", '{"max_tokens": 3}'], "--extra-body"),
    (["--extra-body", "@/no/such/file.json"], "--extra-body"),
])
def test_bad_flags(argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    # every case fails before contacting a server
    with pytest.raises(SystemExit) as e:
        main(["bench", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and says in err and "usage: pdcluster bench" in err, err


def test_defaults_parse() -> None:
    args = build_parser().parse_args(["bench"])
    assert (args.url, args.endpoint, args.dataset, args.concurrency, args.rate) == (
        "http://127.0.0.1:8000", "chat", "random", None, None)
