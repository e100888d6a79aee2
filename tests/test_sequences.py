"""Behaviour sequences in the data: the synthetic generator's and the Amazon (DIN / DIEN) reader's."""

from __future__ import annotations

import gzip
import itertools
from pathlib import Path

import pytest
import torch

from loka_tune.data import AmazonSource, SyntheticCTR, parse_data_spec
from loka_tune.data.hashing import stable_id
from loka_tune.errors import ConfigError, DataError

SEP = "\x02"


@pytest.fixture(scope="module")
def seq_source() -> SyntheticCTR:
    return SyntheticCTR(num_dense=3, cardinalities=(500, 40, 7), seq_len=12, eval_examples=512)


def _left_padded(mask: torch.Tensor) -> bool:
    return bool((mask[:, 1:] >= mask[:, :-1]).all())  # once True, True to the end


def test_synthetic_sequences_layout(seq_source):
    b = next(seq_source.batches("train", 4096, seed=0))
    assert b.seq.shape == (4096, 12) and b.seq.dtype == torch.int64 and b.seq_mask.dtype == torch.bool
    assert _left_padded(b.seq_mask)
    assert int(b.seq.min()) >= 0 and int(b.seq.max()) < 500  # feature 0's id space
    assert bool((b.seq[~b.seq_mask] == 0).all())
    lengths = b.seq_mask.sum(1)
    assert 0.02 < float((lengths == 0).float().mean()) < 0.09  # ~5% cold users
    assert 0.03 < float((lengths == 12).float().mean()) < 0.3  # a pile-up at the cap
    assert 1.5 < float(lengths.float().median()) < 6  # heavy tail: median ~ seq_len / 4
    ev = list(seq_source.batches("eval", 200))
    assert [len(e) for e in ev] == [200, 200, 112] and all(e.seq.shape[1] == 12 for e in ev)


def test_synthetic_sequences_are_deterministic_and_seeded(seq_source):
    a = next(seq_source.batches("train", 64, seed=3))
    b = next(seq_source.batches("train", 64, seed=3))
    c = next(seq_source.batches("train", 64, seed=4))
    assert torch.equal(a.seq, b.seq) and torch.equal(a.seq_mask, b.seq_mask) and torch.equal(a.labels, b.labels)
    assert not torch.equal(a.seq, c.seq)
    e1 = torch.cat([e.seq for e in seq_source.batches("eval", 100)])
    e2 = torch.cat([e.seq for e in seq_source.batches("eval", 512)])
    assert torch.equal(e1, e2)  # the same eval set whatever the batch size


def test_synthetic_clicks_depend_on_the_sequence(seq_source):
    b = next(seq_source.batches("train", 50_000, seed=1))
    seen = ((b.seq == b.sparse[:, :1]) & b.seq_mask).any(1)  # the target is among the events
    ctr_seen, ctr_not = float(b.labels[seen].mean()), float(b.labels[~seen].mean())
    assert ctr_seen > ctr_not + 0.03, (ctr_seen, ctr_not)


def test_synthetic_without_sequences_is_unchanged():
    plain = SyntheticCTR(num_dense=3, cardinalities=(500, 40, 7), eval_examples=64)
    same = SyntheticCTR(num_dense=3, cardinalities=(500, 40, 7), eval_examples=64, seq_len=0)
    a, b = next(plain.batches("train", 32, seed=0)), next(same.batches("train", 32, seed=0))
    assert a.seq is None and a.seq_mask is None
    assert torch.equal(a.sparse, b.sparse) and torch.equal(a.labels, b.labels) and torch.equal(a.dense, b.dense)
    with pytest.raises(ConfigError) as e:
        SyntheticCTR(cardinalities=(5,), seq_len=-1)
    assert e.value.key == "seq_len"
    assert parse_data_spec("synthetic:num_sparse=2,cardinality=50,num_dense=1,seq_len=4").seq_len == 4


# --------------------------------------------------------------------------- Amazon reader


def _row(label, user, item, cat, hist, hist_cats=None):
    hist_cats = [f"c{i % 3}" for i in range(len(hist))] if hist_cats is None else hist_cats
    return "\t".join([str(label), user, item, cat, SEP.join(hist), SEP.join(hist_cats)])


def _write(path: Path, rows: list[str]) -> Path:
    path.write_text("\n".join(rows) + "\n")
    return path


def _rows(n: int = 60) -> list[str]:
    out = []
    for i in range(n):
        hist = [f"B{(i * 7 + j) % 23:04d}" for j in range(i % 9)]  # 0..8 events
        out.append(_row(i % 2, f"U{i % 11}", f"B{i % 23:04d}", f"c{i % 3}", hist))
    return out


def test_amazon_reads_items_users_categories_and_histories(tmp_path):
    path = _write(tmp_path / "local_train_splitByUser", _rows())
    src = AmazonSource(path, seq_len=5, hash_size={"item": 1000, "user": 50, "category": 10}, eval_fraction=0.25)
    assert src.num_dense == 1 and src.sparse_names == ("item", "user", "category") and src.seq_len == 5
    assert src.cardinalities == (1000, 50, 10)
    rows = {int(ln): i for i, ln in enumerate(src.rows("train")["line"])}
    t = src.rows("train")
    i = rows[9]  # line 9: row 8, 8 events, the last 5 kept
    hist = [f"B{(8 * 7 + j) % 23:04d}" for j in range(8)]
    want = [stable_id("item", h, 1000) for h in hist[-5:]]
    assert t["seq"][i].tolist() == want and int(t["seq_count"][i]) == 5
    assert int(t["sparse"][i, 0]) == stable_id("item", "B0008", 1000)  # the same hash as the events
    assert float(t["dense"][i, 0]) == pytest.approx(torch.log1p(torch.tensor(8.0)).item())
    i = rows[4]  # row 3: 3 events, left-padded
    assert t["seq"][i, :2].tolist() == [0, 0] and int(t["seq_count"][i]) == 3
    b = next(src.batches("train", 16, seed=0))
    assert b.seq.shape == (16, 5) and _left_padded(b.seq_mask)
    assert torch.equal(b.seq_mask.sum(1), torch.minimum(torch.tensor(5), b.seq_mask.sum(1)))
    ev = list(src.batches("eval", 1000))
    assert len(ev) == 1 and ev[0].seq.shape[1] == 5 and len(ev[0]) == src.num_eval_rows


def test_amazon_spec_gzip_and_streaming(tmp_path):
    rows = _rows(80)
    gz = tmp_path / "train.gz"
    with gzip.open(gz, "wt") as f:
        f.write("\n".join(rows))  # no final newline
    src = parse_data_spec(f"amazon:{gz}?seq_len=3,hash_size=500")
    assert isinstance(src, AmazonSource) and src.num_train_rows + src.num_eval_rows == 80
    streaming = AmazonSource(gz, seq_len=3, hash_size=500, max_rows=20, shuffle_buffer=16, eval_fraction=src.eval_fraction)
    assert streaming.streaming
    for b in itertools.islice(streaming.batches("train", 8, seed=0), 12):  # several passes
        assert b.seq.shape == (8, 3) and _left_padded(b.seq_mask)
    ev = list(streaming.batches("eval", 7))
    assert sum(len(b) for b in ev) == src.num_eval_rows and all(b.seq is not None for b in ev)


@pytest.mark.parametrize(
    "bad, match",
    [
        ("1\tU1\tB1\tc1\tB2", r"5 tab-separated fields, a row has 6"),
        ("1,U1,B1,c1,B2,c2", r"tab-separated"),
        ("2\tU1\tB1\tc1\tB2\tc2", r"bad label '2'"),
        ("1\tU1\t\tc1\tB2\tc2", r"empty item_id"),
        (_row(0, "U1", "B1", "c1", ["B2", "B3"], ["c1"]), r"2 events but category_history 1"),
        (_row(0, "U1", "B1", "c1", ["B2", "", "B3"], ["c1", "c1", "c2"]), r"empty event at position 1"),
    ],
)
def test_amazon_errors_name_file_line_and_fix(tmp_path, bad, match):
    rows = _rows(10)
    rows.insert(4, bad)  # line 5
    path = _write(tmp_path / "bad.txt", rows)
    with pytest.raises(DataError, match=match) as e:
        AmazonSource(path, seq_len=4)
    assert "bad.txt:5" in str(e.value) and "on_bad_row='skip'" in str(e.value)
    skipped = AmazonSource(path, seq_len=4, on_bad_row="skip")
    assert skipped.skipped_rows == 1 and skipped.skipped_examples[0][0] == 5


def test_amazon_option_errors(tmp_path):
    path = _write(tmp_path / "ok.txt", _rows(10))
    with pytest.raises(ConfigError) as e:
        AmazonSource(path, seq_len=0)
    assert e.value.key == "seq_len"
    with pytest.raises(ConfigError) as e:
        AmazonSource(path, hist_sep="\t")
    assert e.value.key == "hist_sep"
    with pytest.raises(DataError, match="file not found"):
        AmazonSource(tmp_path / "missing.txt")


def test_interformer_trains_on_sequence_data_through_the_trainer(tmp_path):
    from loka_tune.models import build_model
    from loka_tune.objectives.trainer import TrainConfig, train

    src = AmazonSource(_write(tmp_path / "t.txt", _rows(200)), seq_len=6, hash_size=200)
    torch.manual_seed(0)
    model = build_model("interformer", "tiny", num_dense=src.num_dense, cardinalities=list(src.cardinalities))
    res = train(model, src, TrainConfig(steps=6, batch_size=16, window=3), progress=False)
    assert res.status == "ok" and res.eval_logloss is not None and res.eval_logloss > 0
