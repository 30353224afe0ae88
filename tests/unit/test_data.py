"""moefleet.data: named datasets, splits, prompt files, the embedded copy, and errors."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest

from moefleet import paths
from moefleet.data import Prompt, dataset_names, list_datasets, load_file, load_prompts
from moefleet.errors import DataError, UnknownNameError

NAMES = ["wikitext2", "wikitext2-tokens", "c4", "sharegpt", "alpaca", "piqa"]


def _find_shared() -> Path | None:
    for d in paths.shared_data_dirs():
        if d != paths.EMBEDDED_DATA_DIR.resolve() and (d / "piqa").is_dir():
            return d
    return None


SHARED = _find_shared()
needs_shared = pytest.mark.skipif(SHARED is None, reason="../shared/data not present")


@pytest.fixture
def shared(monkeypatch: pytest.MonkeyPatch) -> Path:
    """Point MOEFLEET_DATA_DIR at the full shared data so tests read exactly that copy."""
    assert SHARED is not None
    monkeypatch.setenv("MOEFLEET_DATA_DIR", str(SHARED))
    return SHARED


@pytest.fixture
def embedded_only(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Only an empty data dir plus the package's embedded copy are visible."""
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setattr(paths, "_candidate_data_dirs", lambda: [empty])
    return empty


@pytest.fixture
def data_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A private data dir that alone (plus the embedded copy) is searched."""
    root = tmp_path / "data"
    root.mkdir()
    monkeypatch.setattr(paths, "_candidate_data_dirs", lambda: [root])
    return root


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def _jsonl(path: Path, rows: list[object]) -> Path:
    return _write(path, "".join(json.dumps(r) + "\n" for r in rows))


# --- named datasets -----------------------------------------------------------------


@needs_shared
@pytest.mark.parametrize(
    ("name", "split", "count"),
    [
        ("wikitext2", None, 2185),
        ("wikitext2-tokens", None, 2185),
        ("wikitext2-tokens", "valid", 1841),
        ("c4", None, 300),
        ("sharegpt", None, 500),
        ("alpaca", None, 999),
        ("piqa", None, 1838),
    ],
)
def test_named_dataset_counts_and_invariants(
    shared: Path, name: str, split: str | None, count: int
) -> None:
    prompts = load_prompts(name, split=split)
    assert len(prompts) == count
    assert len({p.request_id for p in prompts}) == count
    assert all(p.text.strip() for p in prompts)


@needs_shared
def test_wikitext2_paragraphs_skip_headings_and_are_stripped(shared: Path) -> None:
    prompts = load_prompts("wikitext2")
    assert prompts[0].request_id == "wikitext2:000000"
    assert prompts[17].request_id == "wikitext2:000017"
    assert prompts[0].text.startswith("Robert Boulter is an English film")
    assert all(p.text == p.text.strip() and not re.fullmatch(r"= .* =", p.text) for p in prompts)
    assert all(p.reference is None for p in prompts)
    tokens = load_prompts("wikitext2-tokens", split="test")
    valid = load_prompts("wikitext2-tokens", split="valid")
    assert "<unk>" in tokens[0].text
    assert not {p.request_id for p in tokens} & {p.request_id for p in valid}


@needs_shared
def test_piqa_reference_is_the_labelled_solution(shared: Path) -> None:
    items = [json.loads(x) for x in (shared / "piqa/valid.jsonl").read_text().splitlines()]
    labels = (shared / "piqa/valid-labels.lst").read_text().split()
    prompts = load_prompts("piqa")
    assert [p.request_id for p in prompts] == [it["id"] for it in items]
    for p, it, lab in zip(prompts, items, labels, strict=True):
        assert p.text == it["goal"]
        assert p.reference == (it["sol1"] if lab == "0" else it["sol2"])
    # Both labels occur, so the test would catch a constant choice.
    assert {p.reference == it["sol2"] for p, it in zip(prompts, items, strict=True)} == {
        True,
        False,
    }


@needs_shared
def test_alpaca_and_sharegpt_fields(shared: Path) -> None:
    items = json.loads((shared / "alpaca_en_demo/alpaca_en_demo.json").read_text())
    prompts = load_prompts("alpaca")
    with_input = 0
    for i, (p, it) in enumerate(zip(prompts, items, strict=True)):
        assert p.request_id == f"alpaca:{i:06d}"
        expected = it["instruction"] + (f"\n\n{it['input']}" if it["input"] else "")
        with_input += bool(it["input"])
        assert (p.text, p.reference) == (expected, it["output"])
    assert with_input > 0
    convs = json.loads(
        (shared / "sharegpt_v3_filtered_500/ShareGPT_V3_filtered_500.json").read_text()
    )
    share = load_prompts("sharegpt")
    assert [p.request_id for p in share] == [c["id"] for c in convs]
    assert [p.text for p in share] == [c["conversations"][0]["value"] for c in convs]
    c4 = load_prompts("c4")
    assert c4[0].request_id == "c4:000000" and c4[0].text.startswith("Don’t think you need")


@needs_shared
@pytest.mark.parametrize(("name", "n_train"), [("wikitext2", 2185 * 95 // 100), ("sharegpt", 400)])
def test_fraction_splits_are_disjoint_contiguous_and_cover_all(
    shared: Path, name: str, n_train: int
) -> None:
    everything = [p.request_id for p in load_prompts(name)]
    train = [p.request_id for p in load_prompts(name, split="train")]
    test = [p.request_id for p in load_prompts(name, split="TEST ")]
    assert len(train) == n_train
    assert train + test == everything
    assert load_prompts(name, split="all") == load_prompts(name)


@needs_shared
def test_limit_keeps_prefix_with_same_ids(shared: Path) -> None:
    assert (
        load_prompts("sharegpt", split="test", limit=3)
        == load_prompts("sharegpt", split="test")[:3]
    )
    assert len(load_prompts("c4", limit=10_000)) == 300


@needs_shared
def test_list_datasets_reports_everything_found(shared: Path) -> None:
    infos = list_datasets()
    assert [i.name for i in infos] == NAMES == dataset_names()
    for info in infos:
        assert info.found and info.location == shared / info.folder
        assert info.default_split in info.splits and info.licence and info.description


# --- directory resolution and the embedded copy -------------------------------------


def test_embedded_copy_loads_when_no_shared_dir(embedded_only: Path) -> None:
    prompts = load_prompts("wikitext2")
    assert len(prompts) == 204
    assert prompts[0].text.startswith("Robert Boulter")
    train, test = load_prompts("wikitext2", split="train"), load_prompts("wikitext2", split="test")
    assert train + test == prompts and len(train) == 204 * 95 // 100
    found = {i.name: i for i in list_datasets()}
    assert found["wikitext2"].location == paths.EMBEDDED_DATA_DIR.resolve() / "wikitext2_raw_test"
    assert not any(found[n].found for n in NAMES if n != "wikitext2")
    if SHARED is not None:  # a byte prefix keeps the full file's ids and texts
        full = load_file(SHARED / "wikitext2_raw_test/wiki.test.raw", id_prefix="wikitext2")
        assert full[:204] == prompts


def test_embedded_provenance_matches_file() -> None:
    folder = paths.EMBEDDED_DATA_DIR / "wikitext2_raw_test"
    data = (folder / "wiki.test.raw").read_bytes()
    provenance = (folder / "PROVENANCE.txt").read_text()
    assert hashlib.sha256(data).hexdigest() in provenance
    assert f"{len(data):,}" in provenance and "CC BY-SA 3.0" in provenance
    assert data.endswith(b"\n") and len(data) <= 150_000


def test_data_dir_env_var_wins_over_other_dirs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _jsonl(tmp_path / "c4_demo/c4_demo.jsonl", [{"text": "one"}, {"text": "two"}])
    _write(tmp_path / "wikitext2_raw_test/wiki.test.raw", " = T = \n a \n\n b \n")
    monkeypatch.setenv("MOEFLEET_DATA_DIR", str(tmp_path))
    assert [p.text for p in load_prompts("c4")] == ["one", "two"]
    assert [p.text for p in load_prompts("wikitext2")] == ["a", "b"]


def test_missing_dataset_names_searched_dirs_and_env_var(embedded_only: Path) -> None:
    with pytest.raises(DataError) as err:
        load_prompts("piqa")
    assert "piqa" in err.value.message and str(embedded_only.resolve()) in err.value.message
    assert "MOEFLEET_DATA_DIR" in err.value.hint


# --- prompt files -------------------------------------------------------------------


def test_txt_file_paragraphs(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_bytes(b" = Title = \r\n\r\n  first para  \r\n = = Sub = = \r\nsecond\r\n   \r\n")
    prompts = load_prompts(str(path))
    assert prompts == [Prompt("notes:000000", "first para"), Prompt("notes:000001", "second")]


def test_jsonl_field_rules(tmp_path: Path) -> None:
    rows: list[object] = [
        {"text": "plain"},
        {"prompt": "p", "completion": "c"},
        {"instruction": "do", "input": "this", "output": "done"},
        {"instruction": "alone", "input": ""},
        {"goal": "g", "sol1": "a", "sol2": "b", "label": 1},
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]},
        {"text": "   "},  # empty text: skipped, but numbering keeps its slot
        {"id": 7, "text": "own id"},
    ]
    got = [
        (p.request_id, p.text, p.reference)
        for p in load_prompts(str(_jsonl(tmp_path / "r.jsonl", rows)))
    ]
    assert got == [
        ("r:000000", "plain", None),
        ("r:000001", "p", "c"),
        ("r:000002", "do\n\nthis", "done"),
        ("r:000003", "alone", None),
        ("r:000004", "g", "b"),
        ("r:000005", "hi", "yo"),
        ("r:000006", "u", None),
        ("7", "own id", None),
    ]


def test_json_list_sharegpt_and_content_detection(tmp_path: Path) -> None:
    items = [
        {
            "id": "a",
            "conversations": [{"from": "gpt", "value": "x"}, {"from": "human", "value": "q"}],
        },
        {"id": "b", "conversations": [{"from": "gpt", "value": "no human turn"}]},
    ]
    json_file = _write(tmp_path / "s.json", json.dumps(items, indent=2))
    assert load_prompts(str(json_file)) == [Prompt("a", "q")]
    # Content beats extension inside the JSON family; no extension is sniffed.
    lines_in_json = _jsonl(tmp_path / "lines.json", [{"text": "l1"}, {"text": "l2"}])
    array_in_jsonl = _write(tmp_path / "arr.jsonl", json.dumps([{"prompt": "a1"}]))
    bare_json = _write(tmp_path / "bare", json.dumps([{"goal": "g"}]))
    bare_text = _write(tmp_path / "plain", "hello\nworld\n")
    assert [p.text for p in load_prompts(str(lines_in_json))] == ["l1", "l2"]
    assert [p.text for p in load_prompts(str(array_in_jsonl))] == ["a1"]
    assert [p.text for p in load_prompts(bare_json)] == ["g"]  # a Path object works too
    assert [p.text for p in load_prompts(str(bare_text), split="all", limit=1)] == ["hello"]


# --- errors -------------------------------------------------------------------------


def test_unknown_name_lists_names_and_suggests(tmp_path: Path) -> None:
    with pytest.raises(UnknownNameError) as err:
        load_prompts("wikitext")
    assert "'wikitext'" in err.value.message
    assert "did you mean 'wikitext2'" in err.value.hint
    assert all(n in err.value.hint for n in NAMES) and ".jsonl" in err.value.hint
    with pytest.raises(UnknownNameError):
        load_prompts("  ")


@needs_shared
@pytest.mark.parametrize(("name", "bad"), [("wikitext2", "valid"), ("c4", "train")])
def test_unknown_split_lists_valid_splits(shared: Path, name: str, bad: str) -> None:
    with pytest.raises(DataError) as err:
        load_prompts(name, split=bad)
    assert repr(bad) in err.value.message
    info = {i.name: i for i in list_datasets()}[name]
    assert all(s in err.value.hint for s in info.splits)


def test_split_on_file_and_bad_limit(tmp_path: Path) -> None:
    path = str(_write(tmp_path / "a.txt", "x\n"))
    with pytest.raises(DataError, match="'train'") as err:
        load_prompts(path, split="train")
    assert "'all'" in err.value.hint
    for bad in (0, -3):
        with pytest.raises(DataError, match=f"got {bad}"):
            load_prompts(path, limit=bad)


def test_empty_inputs(tmp_path: Path, data_dir: Path) -> None:
    with pytest.raises(DataError, match="no usable prompts"):
        load_prompts(str(_write(tmp_path / "h.txt", " = Only = \n\n")))
    with pytest.raises(DataError, match="no usable prompts"):
        load_prompts(str(_write(tmp_path / "e.json", "")))
    _write(data_dir / "wikitext2_raw_test/wiki.test.raw", "one paragraph\n")
    with pytest.raises(DataError, match="split 'train' has no prompts"):
        load_prompts("wikitext2", split="train")
    _write(data_dir / "wikitext2_raw_test/wiki.test.raw", " = H = \n")
    with pytest.raises(DataError, match="no usable prompts"):
        load_prompts("wikitext2")


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("bad.jsonl", '{"text": "ok"}\n{"text": oops}\n', r"bad\.jsonl at line 2"),
        ("bad.json", '[\n {"text": "a"},\n {"text" "b"}\n]', r"bad\.json at line 3"),
        ("obj.json", '{\n "text": "a"\n}', "not a list of objects"),
        (
            "nof.jsonl",
            '{"text": "a"}\n{"body": "b"}\n',
            r"line 2: no prompt field \(fields present: body\)",
        ),
        ("type.jsonl", '{"prompt": 3}\n', "'prompt' must be a string, got int"),
        ("num.jsonl", "1\n2\n", "line 1: expected a JSON object, got int"),
        ("dup.jsonl", '{"id": "x", "text": "a"}\n{"id": "x", "text": "b"}\n', "duplicate id 'x'"),
        ("t.csv", "a,b\n", "unsupported prompt file type '.csv'"),
    ],
)
def test_malformed_files_name_file_and_place(
    tmp_path: Path, name: str, content: str, message: str
) -> None:
    path = _write(tmp_path / name, content)
    with pytest.raises(DataError, match=message) as err:
        load_prompts(str(path))
    assert str(path) in err.value.message and err.value.hint


def test_unreadable_paths(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="file not found") as err:
        load_prompts(str(tmp_path / "nope.jsonl"))
    assert "dataset name" in err.value.hint
    with pytest.raises(DataError, match="is a directory"):
        load_prompts(str(tmp_path))
    latin = tmp_path / "latin.txt"
    latin.write_bytes("caf\xe9\n".encode("latin-1"))
    with pytest.raises(DataError, match="not UTF-8"):
        load_prompts(str(latin))


def test_broken_piqa_copy_is_reported(data_dir: Path) -> None:
    row = {"id": "i", "goal": "g", "sol1": "a", "sol2": "b"}
    _jsonl(data_dir / "piqa/valid.jsonl", [row, row | {"id": "j"}])
    _write(data_dir / "piqa/valid-labels.lst", "0\n")
    with pytest.raises(DataError, match=r"1 labels but .* 2 items"):
        load_prompts("piqa")
    _write(data_dir / "piqa/valid-labels.lst", "0\n2\n")
    with pytest.raises(DataError, match="label '2'"):
        load_prompts("piqa")
    _write(data_dir / "piqa/valid-labels.lst", "1\n0\n")
    assert [(p.request_id, p.reference) for p in load_prompts("piqa")] == [("i", "b"), ("j", "a")]


def test_prompt_rejects_empty_fields() -> None:
    with pytest.raises(DataError, match="empty request_id"):
        Prompt("", "text")
    with pytest.raises(DataError, match="empty text"):
        Prompt("id", " \n")
