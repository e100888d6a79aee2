"""Data sources: synthetic CTR, Criteo and Avazu readers, stable hashing, data specs."""

from __future__ import annotations

import gzip
import hashlib
import itertools
import logging
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from loka_tune.data import (
    AvazuSource,
    Batch,
    CriteoSource,
    DataSource,
    SyntheticCTR,
    parse_data_spec,
    split_uniform,
    stable_id,
    synthetic_for,
)
from loka_tune.errors import ConfigError, DataError

CRITEO_2K = "criteo_kaggle_head2k.tsv"
CRITEO_1K_TRUNC = "criteo_kaggle_head1k_truncated_rows.tsv"
AVAZU_8K = "avazu_head8k.csv"


def _formula_id(feature: str, value: str, hash_size: int) -> int:
    """The documented stable-id formula, written out independently of the library."""
    digest = hashlib.blake2b(f"{feature}={value}".encode(), digest_size=8).digest()
    return 1 + int.from_bytes(digest, "little") % (hash_size - 1)


def _raw_rows(path: Path) -> list[list[str]]:
    text = path.read_text()
    return [line.split("\t") for line in text.split("\n") if line]


# ---------------------------------------------------------------------------------- hashing
def test_stable_id_pinned_values() -> None:
    # pinned: a change here silently re-hashes every dataset users have tuned on
    assert stable_id("C1", "68fd1e64", 100_000) == 43336
    assert stable_id("site_id", "1fbe01fe", 100_000) == 32994
    for feature, value, size in [("C1", "68fd1e64", 100_000), ("C26", "9727dd16", 7), ("x", "é", 2)]:
        assert stable_id(feature, value, size) == _formula_id(feature, value, size)
    assert stable_id("C1", "", 100_000) == 0  # missing
    assert stable_id("C1", "68fd1e64", 100_000) != stable_id("C2", "68fd1e64", 100_000)
    ids = {stable_id("C3", f"{i:08x}", 50) for i in range(2000)}
    assert ids == set(range(1, 50))  # never 0, covers [1, size)
    with pytest.raises(ValueError):
        stable_id("C1", "a", 1)


def test_stable_id_same_in_another_process() -> None:
    # load hashing.py alone (no torch import: fast), in processes with other hash salts
    code = (
        "import importlib.util as u; s = u.spec_from_file_location('h', 'loka_tune/data/hashing.py'); "
        "h = u.module_from_spec(s); s.loader.exec_module(h); print(h.stable_id('C7', 'deadbeef', 123457))"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed, "PATH": ""},
            cwd=Path(__file__).resolve().parents[1],
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert outs == {str(_formula_id("C7", "deadbeef", 123457))}


def test_split_uniform_is_stable_and_uniform() -> None:
    u = split_uniform(np.arange(1, 200_001))
    assert np.array_equal(u, split_uniform(np.arange(1, 200_001)))
    assert 0.0 <= u.min() and u.max() < 1.0
    assert abs((u < 0.2).mean() - 0.2) < 0.005
    assert not np.array_equal(u, split_uniform(np.arange(1, 200_001), salt=1))


# -------------------------------------------------------------------------- real Criteo files
def test_criteo_2k_loads_every_row(shared_data: Path) -> None:
    path = shared_data / CRITEO_2K
    raw = _raw_rows(path)
    assert len(raw) == 1999
    src = CriteoSource(path)
    assert isinstance(src, DataSource)
    assert src.skipped_rows == 0 and not src.streaming
    assert src.num_train_rows + src.num_eval_rows == 1999
    assert src.eval_fraction == 0.2  # auto for a small file
    assert 0.15 < src.num_eval_rows / 1999 < 0.25
    tr, ev = src.rows("train"), src.rows("eval")
    lines = torch.cat([tr["line"], ev["line"]]).sort().values
    assert torch.equal(lines, torch.arange(1, 2000))
    positives = sum(r[0] == "1" for r in raw)
    assert tr["label"].sum() + ev["label"].sum() == positives
    assert src.base_rate == pytest.approx(float(tr["label"].mean()))
    assert 0.15 < src.base_rate < 0.27  # ~21% positives in this sample

    # every value of a few rows, recomputed from the raw text with the documented transforms
    for t in (tr, ev):
        for k in range(0, len(t["line"]), 97):
            fields = raw[int(t["line"][k]) - 1]
            assert t["label"][k] == float(fields[0])
            want_dense = [math.log1p(max(int(v), 0)) if v else 0.0 for v in fields[1:14]]
            assert t["dense"][k].tolist() == pytest.approx(want_dense, rel=1e-6)
            want_ids = [_formula_id(f"C{j}", v, 100_000) if v else 0 for j, v in enumerate(fields[14:], 1)]
            assert t["sparse"][k].tolist() == want_ids


def test_criteo_truncated_rows_load_like_the_full_rows(shared_data: Path) -> None:
    path = shared_data / CRITEO_1K_TRUNC
    data = path.read_bytes()
    assert not data.endswith(b"\n")  # the dirty variant: no final newline
    raw = _raw_rows(path)
    assert len(raw) == 1000
    assert sum(len(r) < 40 for r in raw) == 498
    src = CriteoSource(path)
    assert src.skipped_rows == 0
    assert src.num_train_rows + src.num_eval_rows == 1000
    # the same rows, untruncated, are the first 1000 of the 2k file; same lines -> same split
    full = CriteoSource(shared_data / CRITEO_2K)
    for split in ("train", "eval"):
        a, b = src.rows(split), full.rows(split)
        keep = b["line"] <= 1000
        for key in ("line", "label", "dense", "sparse"):
            assert torch.equal(a[key], b[key][keep]), (split, key)


def test_avazu_loads_every_row(shared_data: Path) -> None:
    path = shared_data / AVAZU_8K
    src = AvazuSource(path)
    assert isinstance(src, DataSource)
    assert src.skipped_rows == 0
    assert src.num_train_rows + src.num_eval_rows == 8087
    assert src.num_dense == 2 and src.dense_names == ("hour_of_day", "day_of_week")
    assert src.num_sparse == 21 and "id" not in src.sparse_names and "click" not in src.sparse_names
    assert len(src.cardinalities) == 21
    assert 0.12 < src.base_rate < 0.22  # ~17% positives
    lines = path.read_text().splitlines()
    header = lines[0].split(",")
    tr = src.rows("train")
    k = 5
    fields = lines[int(tr["line"][k]) - 1].split(",")
    assert tr["label"][k] == float(fields[header.index("click")])
    # 14102100 is 2014-10-21 00h, a Tuesday (weekday 1)
    assert tr["dense"][k].tolist() == pytest.approx([0.0, 1 / 6])
    cats = [c for c in header if c not in ("id", "click", "hour")]
    assert tr["sparse"][k].tolist() == [_formula_id(c, fields[header.index(c)], 100_000) for c in cats]


# -------------------------------------------------------------------------- batching (files)
def _criteo_line(rng: np.random.Generator, label: int | None = None) -> str:
    lab = int(rng.integers(0, 2)) if label is None else label
    ints = ["" if rng.random() < 0.2 else str(int(rng.integers(-1, 500))) for _ in range(13)]
    cats = ["" if rng.random() < 0.1 else f"{int(rng.integers(0, 2**32)):08x}" for _ in range(26)]
    return "\t".join([str(lab), *ints, *cats])


def _write_criteo(path: Path, n: int, seed: int = 0, end: str = "\n") -> list[str]:
    rng = np.random.default_rng(seed)
    lines = [_criteo_line(rng) for _ in range(n)]
    path.write_text(end.join(lines) + end, newline="")
    return lines


def test_file_batches_deterministic_cover_and_cycle(tmp_path: Path) -> None:
    path = tmp_path / "c.tsv"
    _write_criteo(path, 300)
    src = CriteoSource(path, eval_fraction=0.25, hash_size=1000)
    n_train = src.num_train_rows
    assert src.cardinalities == (1000,) * 26

    def take(seed: int, k: int, bs: int = 64) -> list[Batch]:
        return list(itertools.islice(src.batches("train", bs, seed=seed), k))

    a, b, c = take(0, 12), take(0, 12), take(1, 12)
    for x, y in zip(a, b):
        assert torch.equal(x.sparse, y.sparse) and torch.equal(x.dense, y.dense)
    assert not all(torch.equal(x.sparse, y.sparse) for x, y in zip(a, c))
    for x in a:
        assert len(x) == 64 and x.sparse.dtype == torch.int64 and x.dense.dtype == torch.float32
        assert x.labels.dtype == torch.float32 and x.dense.shape == (64, 13) and x.sparse.shape == (64, 26)
        assert int(x.sparse.max()) < 1000 and int(x.sparse.min()) >= 0
    # the first n_train rows of the stream are each train row once; the next epoch reshuffles
    stream_labels = torch.cat([x.labels for x in a])
    stream_ids = torch.cat([x.sparse for x in a])
    train = src.rows("train")
    first_epoch = stream_ids[:n_train]
    assert sorted(map(tuple, first_epoch.tolist())) == sorted(map(tuple, train["sparse"].tolist()))
    assert stream_labels[:n_train].sum() == train["label"].sum()
    assert not torch.equal(stream_ids[n_train : 2 * n_train], first_epoch)

    ev = list(src.batches("eval", 50))
    assert sum(len(x) for x in ev) == src.num_eval_rows
    assert all(len(x) == 50 for x in ev[:-1])
    assert torch.equal(torch.cat([x.sparse for x in ev]), src.rows("eval")["sparse"])  # file order
    train_rows = set(map(tuple, train["sparse"].tolist()))
    assert not train_rows & set(map(tuple, src.rows("eval")["sparse"].tolist()))
    # same split from a fresh instance, and eval = the documented hash of the line number
    again = CriteoSource(path, eval_fraction=0.25, hash_size=1000)
    assert torch.equal(again.rows("eval")["line"], src.rows("eval")["line"])
    lines = np.arange(1, 301)
    assert src.rows("eval")["line"].tolist() == lines[split_uniform(lines, 0x10CA) < 0.25].tolist()


def test_streaming_mode_matches_in_memory(tmp_path: Path) -> None:
    path = tmp_path / "c.tsv"
    _write_criteo(path, 400, seed=3)
    mem = CriteoSource(path, eval_fraction=0.2)
    st = CriteoSource(path, eval_fraction=0.2, max_rows=100, shuffle_buffer=64)
    assert st.streaming and st.num_train_rows is None
    with pytest.raises(DataError, match="max_rows"):
        st.rows("train")
    ev = list(st.batches("eval", 32))
    assert torch.equal(torch.cat([x.sparse for x in ev]), mem.rows("eval")["sparse"])
    assert len(list(st.batches("eval", 32))) == len(ev)  # finite, repeatable
    capped = CriteoSource(path, eval_fraction=0.2, max_rows=100, max_eval_rows=10)
    assert sum(len(x) for x in capped.batches("eval", 4)) == 10
    n_train = mem.num_train_rows
    k = n_train // 16 + 3
    a = torch.cat([x.sparse for x in itertools.islice(st.batches("train", 16, seed=5), k)])
    b = torch.cat([x.sparse for x in itertools.islice(st.batches("train", 16, seed=5), k)])
    assert torch.equal(a, b)
    assert sorted(map(tuple, a[:n_train].tolist())) == sorted(map(tuple, mem.rows("train")["sparse"].tolist()))
    c = torch.cat([x.sparse for x in itertools.islice(st.batches("train", 16, seed=6), k)])
    assert not torch.equal(a, c)


# -------------------------------------------------------------------------- bad Criteo input
def _lines_with(tmp_path: Path, bad: dict[int, str], n: int = 8, name: str = "bad.tsv") -> Path:
    """A Criteo file of ``n`` good rows where 1-based line i is replaced by ``bad[i]``."""
    rng = np.random.default_rng(1)
    lines = [_criteo_line(rng) for _ in range(n)]
    for i, text in bad.items():
        lines[i - 1] = text
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


def _fields(label: str = "0") -> list[str]:
    return [label, *["3"] * 13, *["0a1b2c3d"] * 26]


@pytest.mark.parametrize(
    "line_no, text, match",
    [
        (3, "\t".join(_fields()[:5] + ["12x"] + _fields()[6:]), r"I5 is '12x', not an integer"),
        (4, "\t".join(_fields() + ["extra"]), r"too many fields: 41"),
        (2, "\t".join(_fields("2")), r"bad label '2'"),
        (5, "\t".join(_fields()[:20]), r"too few fields: 20"),
        (6, "1,2,3", r"too few fields: 1"),
        (7, "\t".join(_fields()[1:]), r"bad label '3'.*unlabeled Criteo test file"),
        (1, "\t".join(["label", *[f"I{j}" for j in range(1, 14)], *[f"C{j}" for j in range(1, 27)]]), r"no header"),
    ],
)
def test_criteo_bad_rows_name_file_and_line(tmp_path: Path, line_no: int, text: str, match: str) -> None:
    path = _lines_with(tmp_path, {line_no: text})
    with pytest.raises(DataError, match=match) as e:
        CriteoSource(path)
    assert e.value.path == str(path) and e.value.line == line_no
    assert f"{path}:{line_no}:" in str(e.value) and "on_bad_row='skip'" in str(e.value)


def test_criteo_line_numbers_count_blank_lines(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    text = "\n".join([_criteo_line(rng), "", _criteo_line(rng), "   ", "\t".join(_fields("x"))]) + "\n"
    path = tmp_path / "blank.tsv"
    path.write_text(text)
    with pytest.raises(DataError) as e:
        CriteoSource(path)
    assert e.value.line == 5


def test_criteo_skip_mode_counts_and_reports(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    bad = {2: "\t".join(_fields("7")), 9: "\t".join(_fields() + ["x"]), 15: "junk"}
    path = _lines_with(tmp_path, bad, n=40)
    with caplog.at_level(logging.WARNING, logger="loka_tune.data"):
        src = CriteoSource(path, on_bad_row="skip", eval_fraction=0.3)
    assert src.skipped_rows == 3
    assert [ln for ln, _ in src.skipped_examples] == [2, 9, 15]
    assert src.num_train_rows + src.num_eval_rows == 37
    assert "skipped 3 bad row(s)" in caplog.text and "lines 2, 9, 15" in caplog.text
    # re-reading in streaming mode does not count the same bad rows twice
    st = CriteoSource(path, on_bad_row="skip", eval_fraction=0.3, max_rows=5, shuffle_buffer=8)
    list(itertools.islice(st.batches("train", 4), 30))  # several passes over the file
    list(st.batches("eval", 4))
    assert st.skipped_rows == 3


def test_criteo_streaming_raises_on_bad_row_past_prefix(tmp_path: Path) -> None:
    path = _lines_with(tmp_path, {30: "\t".join(_fields("9"))}, n=40)
    st = CriteoSource(path, max_rows=10, eval_fraction=0.3)
    with pytest.raises(DataError) as e:
        list(st.batches("eval", 4))
    assert e.value.line == 30


def test_criteo_file_level_errors(tmp_path: Path) -> None:
    missing = tmp_path / "nope.tsv"
    with pytest.raises(DataError, match="file not found") as e:
        CriteoSource(missing)
    assert e.value.path == str(missing) and "criteo:" in str(e.value)
    empty = tmp_path / "empty.tsv"
    empty.write_bytes(b"")
    with pytest.raises(DataError, match="empty file") as e:
        CriteoSource(empty)
    assert e.value.path == str(empty)
    blank = tmp_path / "blank.tsv"
    blank.write_text("\n\n  \n")
    with pytest.raises(DataError, match="no data rows"):
        CriteoSource(blank)
    with pytest.raises(DataError, match="directory"):
        CriteoSource(tmp_path)
    binary = tmp_path / "bin.tsv"
    binary.write_bytes(_criteo_line(np.random.default_rng(0)).encode() + b"\n\xff\xfe\x00garbage\n")
    with pytest.raises(DataError, match="not UTF-8") as e:
        CriteoSource(binary)
    assert e.value.line == 2
    good = tmp_path / "good.tsv"
    _write_criteo(good, 50)
    broken = tmp_path / "broken.gz"
    broken.write_bytes(gzip.compress(good.read_bytes())[:-30])  # truncated gzip stream
    with pytest.raises(DataError, match="truncated or corrupt"):
        CriteoSource(broken)
    tiny = tmp_path / "tiny.tsv"
    _write_criteo(tiny, 1)
    with pytest.raises(DataError, match="split is empty"):
        CriteoSource(tiny)
    with pytest.raises(ConfigError, match="on_bad_row"):
        CriteoSource(good, on_bad_row="ignore")
    with pytest.raises(ConfigError, match="hash_size"):
        CriteoSource(good, hash_size=[10] * 25)


def test_criteo_crlf_gzip_and_no_final_newline_load_the_same(tmp_path: Path) -> None:
    lf = tmp_path / "lf.tsv"
    lines = _write_criteo(lf, 120, seed=7)
    crlf = tmp_path / "crlf.tsv"
    crlf.write_bytes(("\r\n".join(lines) + "\r\n").encode())
    nofinal = tmp_path / "nofinal.tsv"
    nofinal.write_text("\n".join(lines))
    gz = tmp_path / "data.tsv"  # gzip content without a .gz suffix: detected by magic bytes
    gz.write_bytes(gzip.compress(lf.read_bytes()))
    gz_crlf = tmp_path / "crlf.tsv.gz"
    gz_crlf.write_bytes(gzip.compress(crlf.read_bytes()))
    ref = CriteoSource(lf)
    for path in (crlf, nofinal, gz, gz_crlf):
        src = CriteoSource(path)
        assert src.skipped_rows == 0
        for split in ("train", "eval"):
            a, b = ref.rows(split), src.rows(split)
            for key in a:
                assert torch.equal(a[key], b[key]), (path.name, split, key)


# -------------------------------------------------------------------------- bad Avazu input
AVAZU_HEADER = (
    "id,click,hour,C1,banner_pos,site_id,site_domain,site_category,app_id,app_domain,"
    "app_category,device_id,device_ip,device_model,device_type,device_conn_type,C14,C15,C16,"
    "C17,C18,C19,C20,C21"
)


def _avazu_row(i: int, click: str = "0", hour: str = "14102313") -> str:
    vals = [str(10**18 + i), click, hour, "1005", "0", f"{i % 7:08x}", "f3845767", "28905ebd"]
    vals += ["ecad2386", "7801e8d9", "07d7df22", "a99f214a", f"{i:08x}", "711ee120", "1", "0"]
    vals += ["15704", "320", "50", "1722", "0", "35", "", "79"]  # C20 empty -> id 0
    return ",".join(vals)


def _write_avazu(path: Path, rows: list[str], header: str = AVAZU_HEADER) -> Path:
    path.write_text("\n".join([header, *rows]) + "\n")
    return path


def test_avazu_rows_and_hour_features(tmp_path: Path) -> None:
    path = _write_avazu(tmp_path / "a.csv", [_avazu_row(i, click=str(i % 2)) for i in range(50)])
    src = AvazuSource(path, eval_fraction=0.3)
    rows = src.rows("train")
    assert src.num_train_rows + src.num_eval_rows == 50
    # 14102313: 2014-10-23 13h, a Thursday (weekday 3)
    assert rows["dense"][0].tolist() == pytest.approx([13 / 23, 3 / 6])
    assert int(rows["sparse"][0, src.sparse_names.index("C20")]) == 0
    gz = tmp_path / "a.csv.gz"
    gz.write_bytes(gzip.compress(path.read_bytes().replace(b"\n", b"\r\n")))
    assert torch.equal(AvazuSource(gz, eval_fraction=0.3).rows("train")["sparse"], rows["sparse"])


def test_avazu_errors(tmp_path: Path) -> None:
    rows = [_avazu_row(i) for i in range(20)]
    no_click = _write_avazu(tmp_path / "test.csv", rows, header=AVAZU_HEADER.replace("click,", "clicked,"))
    with pytest.raises(DataError, match=r"lacks column\(s\) \['click'\]; columns found: id,clicked,hour") as e:
        AvazuSource(no_click)
    assert e.value.line == 1 and e.value.path == str(no_click)

    bad = list(rows)
    bad[4] = bad[4] + ",extra"  # line 6 (header is line 1)
    with pytest.raises(DataError, match="25 comma-separated fields, the header has 24") as e:
        AvazuSource(_write_avazu(tmp_path / "f.csv", bad))
    assert e.value.line == 6
    bad = list(rows)
    bad[9] = _avazu_row(9, hour="14133100")  # month 13
    with pytest.raises(DataError, match="expected YYMMDDHH") as e:
        AvazuSource(_write_avazu(tmp_path / "h.csv", bad))
    assert e.value.line == 11
    bad = list(rows)
    bad[0] = _avazu_row(0, click="yes")
    with pytest.raises(DataError, match="bad label") as e:
        AvazuSource(_write_avazu(tmp_path / "l.csv", bad))
    assert e.value.line == 2
    dup = _write_avazu(tmp_path / "d.csv", rows, header=AVAZU_HEADER.replace("C21", "C20"))
    with pytest.raises(DataError, match="duplicate"):
        AvazuSource(dup)
    empty = tmp_path / "e.csv"
    empty.write_text("")
    with pytest.raises(DataError, match="empty"):
        AvazuSource(empty)
    only_header = _write_avazu(tmp_path / "o.csv", [])
    with pytest.raises(DataError, match="no data rows"):
        AvazuSource(only_header)

    bad = list(rows)
    bad[2] = _avazu_row(2, click="2")
    bad[7] = "1,2,3"
    src = AvazuSource(_write_avazu(tmp_path / "s.csv", bad), on_bad_row="skip", eval_fraction=0.3)
    assert src.skipped_rows == 2 and [ln for ln, _ in src.skipped_examples] == [4, 9]
    assert src.num_train_rows + src.num_eval_rows == 18


# -------------------------------------------------------------------------- synthetic
SMALL = dict(num_dense=5, cardinalities=(3, 50, 1000, 20_000), eval_examples=2048)


@pytest.fixture(scope="module")
def small() -> SyntheticCTR:
    return SyntheticCTR(**SMALL)


def test_synthetic_shapes_dtypes_ranges(small: SyntheticCTR) -> None:
    src = small
    assert isinstance(src, DataSource)
    b = next(src.batches("train", 512, seed=0))
    assert b.dense.shape == (512, 5) and b.dense.dtype == torch.float32
    assert b.sparse.shape == (512, 4) and b.sparse.dtype == torch.int64
    assert b.labels.shape == (512,) and b.labels.dtype == torch.float32
    assert set(b.labels.unique().tolist()) <= {0.0, 1.0}
    assert (b.dense >= 0).all() and torch.isfinite(b.dense).all()
    for f, c in enumerate(src.cardinalities):
        assert 0 <= int(b.sparse[:, f].min()) and int(b.sparse[:, f].max()) < c
    s = synthetic_for(num_sparse=8, cardinality=500, num_dense=3)
    assert s.cardinalities == (500,) * 8 and s.num_dense == 3


def test_synthetic_deterministic_per_seed(small: SyntheticCTR) -> None:
    a, b = small, SyntheticCTR(**SMALL)
    for x, y in zip(itertools.islice(a.batches("train", 256, seed=3), 4), itertools.islice(b.batches("train", 256, seed=3), 4)):
        assert torch.equal(x.sparse, y.sparse) and torch.equal(x.dense, y.dense) and torch.equal(x.labels, y.labels)
    x = next(a.batches("train", 256, seed=3))
    y = next(a.batches("train", 256, seed=4))
    assert not torch.equal(x.sparse, y.sparse) and not torch.equal(x.dense, y.dense)
    # eval: the same fixed set whatever the seed and batch size; finite
    e1 = list(a.batches("eval", 1000, seed=0))
    e2 = list(b.batches("eval", 512, seed=9))
    assert [len(e) for e in e1] == [1000, 1000, 48]
    for key in ("dense", "sparse", "labels"):
        assert torch.equal(torch.cat([getattr(e, key) for e in e1]), torch.cat([getattr(e, key) for e in e2]))
    # another teacher seed is another world
    c = SyntheticCTR(**SMALL, teacher_seed=99)
    assert not torch.equal(next(c.batches("eval", 2048)).sparse, torch.cat([e.sparse for e in e1]))


def test_synthetic_train_eval_disjoint(small: SyntheticCTR) -> None:
    src = small
    ev = next(src.batches("eval", 2048))
    eval_rows = set(map(tuple, torch.cat([ev.dense, ev.sparse.float()], 1).tolist()))
    for seed in (0, 1):
        for b in itertools.islice(src.batches("train", 4096, seed=seed), 2):
            rows = set(map(tuple, torch.cat([b.dense, b.sparse.float()], 1).tolist()))
            assert not rows & eval_rows


@pytest.mark.parametrize("target", [0.2, 0.05])
def test_synthetic_base_rate(target: float) -> None:
    src = SyntheticCTR(**SMALL, base_rate=target)
    labels = torch.cat([b.labels for b in itertools.islice(src.batches("train", 8192, seed=1), 4)])
    tol = 4 * math.sqrt(target * (1 - target) / labels.numel()) + 0.005  # sampling + calibration
    assert abs(float(labels.mean()) - target) < tol
    assert abs(src.base_rate - target) < 0.01
    assert src.target_base_rate == target
    ev = torch.cat([b.labels for b in src.batches("eval", 4096)])
    assert abs(float(ev.mean()) - target) < 4 * math.sqrt(target * (1 - target) / ev.numel()) + 0.005


def test_synthetic_labels_carry_signal(small: SyntheticCTR) -> None:
    from loka_tune.data import synthetic as syn

    src = small
    g = torch.Generator().manual_seed(0)
    _, _, labels, p = syn._rows(src._world, 20_000, g, "cpu")
    # AUC of the teacher probability: well above chance, and labels are Bernoulli(p)
    order = torch.argsort(p)
    ranks = torch.empty_like(p)
    ranks[order] = torch.arange(1, len(p) + 1, dtype=p.dtype)
    pos = labels.bool()
    n1, n0 = int(pos.sum()), int((~pos).sum())
    auc = (float(ranks[pos].sum()) - n1 * (n1 + 1) / 2) / (n1 * n0)
    assert auc > 0.7
    assert abs(float(labels.mean()) - float(p.mean())) < 0.015


def test_synthetic_zipf_head_is_heavy() -> None:
    src = SyntheticCTR(num_dense=2, cardinalities=(100_000, 1000), zipf_exponent=1.1, eval_examples=16)
    ids = torch.cat([b.sparse for b in itertools.islice(src.batches("train", 50_000, seed=0), 2)])
    n = ids.shape[0]
    for f, card in enumerate((100_000, 1000)):
        counts = torch.bincount(ids[:, f], minlength=card).double()
        top = float(counts.max()) / n
        zipf_top = 1.0 / float((torch.arange(1, card + 1, dtype=torch.float64) ** -1.1).sum())
        assert top > 100 / card  # >> uniform
        assert abs(top - zipf_top) < 0.02  # the hottest id has the Zipf rank-1 mass
        # heavy tail: the top 1% of ids carry a large share of the traffic
        top1 = counts.sort(descending=True).values[: card // 100].sum() / n
        assert top1 > 0.4
    flat = SyntheticCTR(num_dense=2, cardinalities=(100,), zipf_exponent=0.0, eval_examples=16)
    ids = torch.cat([b.sparse for b in itertools.islice(flat.batches("train", 50_000, seed=0), 1)])
    assert float(torch.bincount(ids[:, 0]).max()) / 50_000 < 0.015  # uniform: ~1%


def test_zipf_tail_of_huge_features_matches_exact_masses() -> None:
    from loka_tune.data import synthetic as syn

    g = torch.Generator().manual_seed(0)
    for card, s in [(3_000_000, 1.1), (3_000_000, 1.0), (300_000, 0.0)]:
        plan, cdf, perm = syn._zipf(card, s, g)
        assert plan.head < card and (perm is None) == (card > 1 << 20)
        ranks = plan.ranks(cdf, torch.rand(1_000_000, generator=g, dtype=torch.float64))
        assert int(ranks.min()) >= 0 and int(ranks.max()) < card
        exact = torch.arange(1, card + 1, dtype=torch.float64).pow(-s)
        exact /= exact.sum()
        edges = [0, 10, 1000, plan.head, 2 * plan.head, 8 * plan.head, card]
        for lo, hi in zip(edges[:-1], edges[1:]):
            lo, hi = min(lo, card), min(hi, card)
            want = float(exact[lo:hi].sum())
            got = float(((ranks >= lo) & (ranks < hi)).double().mean())
            assert abs(got - want) < 5 * math.sqrt(want * (1 - want) / 1e6) + 1e-4, (card, s, lo, hi)
    big = SyntheticCTR(num_dense=1, cardinalities=(3_000_000, 5), eval_examples=16)
    ids = next(big.batches("train", 100_000, seed=0)).sparse[:, 0]
    assert 0 <= int(ids.min()) and int(ids.max()) < 3_000_000
    counts = torch.bincount(ids).double()
    top = counts.sort(descending=True).values
    exact = torch.arange(1, 3_000_001, dtype=torch.float64).pow(-1.1)
    exact /= exact.sum()
    assert abs(float(top[:10].sum()) / 1e5 - float(exact[:10].sum())) < 0.01  # affine map is 1:1


def test_synthetic_missing_rate_and_heavy_tails() -> None:
    def zero_frac(m: float) -> torch.Tensor:
        src = SyntheticCTR(num_dense=13, cardinalities=(10,), missing_rate=m, eval_examples=16)
        d = next(src.batches("train", 20_000, seed=0)).dense
        return (d == 0).double().mean(0)  # (D,)

    z0, z3 = zero_frac(0.0), zero_frac(0.3)
    # a value is 0 when missing or a zero count: z(m) = m + (1 - m) z(0), per feature
    assert torch.allclose(z3, 0.3 + 0.7 * z0, atol=0.02)
    assert (z0 < 0.7).all()
    src = SyntheticCTR(num_dense=13, cardinalities=(10,), missing_rate=0.1, eval_examples=16)
    d = next(src.batches("train", 20_000, seed=2)).dense
    counts = torch.expm1(d.double())  # back to counts
    nz = counts[counts > 0]
    assert float(nz.max()) / float(nz.median()) > 100  # heavy tail, not a narrow bell
    small = counts[counts < 100]
    assert torch.allclose(small, small.round(), atol=1e-3)  # integer counts


def test_synthetic_bad_arguments() -> None:
    for kw, key in [
        (dict(base_rate=1.5), "base_rate"),
        (dict(cardinalities=()), "cardinalities"),
        (dict(cardinalities=(10, 0)), "cardinalities"),
        (dict(missing_rate=1.0), "missing_rate"),
        (dict(eval_examples=0), "eval_examples"),
        (dict(cardinalities="abc"), "cardinalities"),
        (dict(cardinalities=(10, 2**40)), "cardinalities"),
    ]:
        with pytest.raises(ConfigError) as e:
            SyntheticCTR(**kw)
        assert e.value.key == key
    src = synthetic_for(2, 10, num_dense=1)
    with pytest.raises(ConfigError, match="split"):
        src.batches("test", 8)
    with pytest.raises(ConfigError, match="batch_size"):
        src.batches("train", 0)


@pytest.mark.gpu
def test_synthetic_on_cuda() -> None:
    src = SyntheticCTR(**SMALL)
    b = next(src.batches("train", 4096, seed=0, device="cuda"))
    assert b.sparse.device.type == "cuda" and b.dense.device.type == "cuda"
    again = next(src.batches("train", 4096, seed=0, device="cuda"))
    assert torch.equal(b.sparse, again.sparse)
    labels = torch.cat([x.labels for x in itertools.islice(src.batches("train", 8192, seed=0, device="cuda"), 4)])
    assert abs(float(labels.mean()) - 0.2) < 0.02
    ev_gpu = next(src.batches("eval", 2048, device="cuda"))
    ev_cpu = next(src.batches("eval", 2048))
    assert torch.equal(ev_gpu.sparse.cpu(), ev_cpu.sparse)  # eval is the same set everywhere


# -------------------------------------------------------------------------- data specs
def test_parse_data_spec_forms(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = parse_data_spec("synthetic")  # the defaults: Criteo-like 13 dense, 26 sparse
    assert isinstance(s, SyntheticCTR) and s.num_sparse == 26 and s.num_dense == 13
    s = parse_data_spec("synthetic:num_sparse=4,cardinality=100,base_rate=0.1,name=tiny")
    assert s.cardinalities == (100,) * 4 and s.target_base_rate == 0.1 and s.name == "tiny"
    s = parse_data_spec("synthetic:cardinalities=10/20/30,num_dense=2", eval_examples=64)
    assert s.cardinalities == (10, 20, 30) and s.num_dense == 2 and s.eval_examples == 64
    assert parse_data_spec("synthetic:cardinalities=7,num_dense=0").cardinalities == (7,)

    path = tmp_path / "c.tsv"
    _write_criteo(path, 100)
    c = parse_data_spec(f"criteo:{path}", eval_fraction=0.3)
    assert isinstance(c, CriteoSource) and c.eval_fraction == 0.3 and c.name == "criteo:c.tsv"
    c = parse_data_spec(f"criteo:{path}?hash_size=77,eval_fraction=0.25")
    assert c.cardinalities == (77,) * 26 and c.eval_fraction == 0.25
    a_path = _write_avazu(tmp_path / "a.csv", [_avazu_row(i) for i in range(30)])
    assert isinstance(parse_data_spec(f"avazu:{a_path}", eval_fraction=0.3), AvazuSource)

    mod = tmp_path / "my_data_mod.py"
    mod.write_text(
        "from loka_tune.data import synthetic_for\n"
        "def make(**kw):\n    return synthetic_for(2, 10, num_dense=1, eval_examples=8, **kw)\n"
        "def not_a_source(**kw):\n    return 42\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    u = parse_data_spec("my_data_mod:make", base_rate=0.3)
    assert u.cardinalities == (10, 10) and u.target_base_rate == 0.3
    with pytest.raises(ConfigError, match="returned int, not a DataSource"):
        parse_data_spec("my_data_mod:not_a_source")
    with pytest.raises(ConfigError, match="has no callable 'missing'"):
        parse_data_spec("my_data_mod:missing")
    with pytest.raises(ConfigError, match="cannot import module 'no_such_mod_xyz.sub'"):
        parse_data_spec("no_such_mod_xyz.sub:make")


@pytest.mark.parametrize(
    "spec, match",
    [
        ("", "empty data spec"),
        ("criteo", "has no file path"),
        ("criteo:", "has no file path"),
        ("/data/train.txt", "unknown data spec '/data/train.txt'"),
        ("parquet:/x", "unknown data spec 'parquet:/x'"),
        ("synthetic:base_rate", "not key=value"),
        ("synthetic:colour=blue", r"unknown option\(s\) \['colour'\]"),
    ],
)
def test_parse_data_spec_errors(spec: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as e:
        parse_data_spec(spec)
    assert e.value.key == "data"
    if "unknown data spec" in match or "empty" in match:
        assert "synthetic" in str(e.value) and "package.module:function" in str(e.value)
