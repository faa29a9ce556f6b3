"""Sequence classification files: TSV/CSV/JSONL, pairs, GLUE layouts, label sets, truncation, errors."""

from __future__ import annotations

import csv
import json
import warnings

import pytest
import torch

from transnormer.data import (
    ClassificationCollator,
    ClassificationDataset,
    LabelSet,
    Scores,
    labels_of,
    load_classification_splits,
    read_classification_file,
    train_bpe,
)


@pytest.fixture(scope="module")
def tok():
    text = "the movie was great and the plot was not bad but the acting is terrible what a film " * 30
    return train_bpe([text, "Amrozi accused his brother of deliberately distorting evidence ."], vocab_size=320)


def _write(path, text: str, encoding="utf-8"):
    path.write_text(text, encoding=encoding)
    return path


# -------------------------------------------------------------------------------------------------- GLUE


def test_sst2_tsv_with_quotes_and_unlabelled_test(tmp_path):
    train = _write(tmp_path / "train.tsv", 'sentence\tlabel\nhe said "great movie\t1\nterrible acting \t0\n\n')
    exs = read_classification_file(train)
    assert [(e.text, e.text_pair, e.label, e.line) for e in exs] == [
        ('he said "great movie', None, "1", 2),
        ("terrible acting ", None, "0", 3),
    ]
    test = _write(tmp_path / "test.tsv", "index\tsentence\n0\ta film\n1\tthe plot\n")
    unlabelled = read_classification_file(test)
    assert [e.label for e in unlabelled] == [None, None] and unlabelled[1].text == "the plot"


def test_cola_headerless(tmp_path):
    path = _write(
        tmp_path / "in_domain_train.tsv",
        "gj04\t1\t\tOur friends won't buy this analysis.\ngj04\t0\t*\tThe more we study verbs, the crazier.\n",
    )
    exs = read_classification_file(path)
    assert [(e.text, e.label) for e in exs] == [
        ("Our friends won't buy this analysis.", "1"),
        ("The more we study verbs, the crazier.", "0"),
    ]


def test_mrpc_with_bom_pairs(tmp_path):
    path = _write(
        tmp_path / "msr_paraphrase_train.txt",
        "\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String\n"
        "1\t702876\t702977\tAmrozi accused his brother .\tReferring to him as the witness .\n",
    )
    (ex,) = read_classification_file(path)
    assert (ex.text, ex.text_pair, ex.label) == (
        "Amrozi accused his brother .",
        "Referring to him as the witness .",
        "1",
    )


def test_qnli_rte_mnli_columns(tmp_path):
    qnli = _write(tmp_path / "qnli.tsv", "index\tquestion\tsentence\tlabel\n0\tWhat came?\tThe treaty.\tentailment\n")
    (q,) = read_classification_file(qnli)
    assert (q.text, q.text_pair, q.label) == ("What came?", "The treaty.", "entailment")
    rte = _write(tmp_path / "rte.tsv", "index\tsentence1\tsentence2\tlabel\n0\tA dog.\tAn animal.\tnot_entailment\n")
    (r,) = read_classification_file(rte)
    assert (r.text, r.text_pair, r.label) == ("A dog.", "An animal.", "not_entailment")
    header = "index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\tsentence2_binary_parse\tsentence1\tsentence2\tlabel1\tgold_label\n"
    mnli = _write(
        tmp_path / "dev_matched.tsv",
        header + "0\t1\t1e\tgov\t( x )\t( y )\tPremise here.\tHypothesis.\tneutral\tentailment\n",
    )
    (m,) = read_classification_file(mnli)
    assert (m.text, m.text_pair, m.label) == ("Premise here.", "Hypothesis.", "entailment")
    mnli_test = _write(tmp_path / "test_matched.tsv", "index\tsentence1\tsentence2\n0\tP.\tH.\n")
    assert read_classification_file(mnli_test)[0].label is None


# ---------------------------------------------------------------------------------------- CSV and JSONL


def test_csv_quoting_multiline_and_explicit_columns(tmp_path):
    path = _write(
        tmp_path / "reviews.csv",
        'id,review,stars\n1,"good, really good",pos\n2,"line one\nline two",neg\n3,plain,pos\n',
    )
    exs = read_classification_file(path, label_column="stars")
    assert [(e.text, e.label, e.line) for e in exs] == [
        ("good, really good", "pos", 2),
        ("line one\nline two", "neg", 3),
        ("plain", "pos", 5),
    ]
    headerless = _write(tmp_path / "h.csv", "pos,nice film\nneg,bad film\n")
    exs = read_classification_file(headerless, text_column=1, label_column=0)
    assert [(e.text, e.label) for e in exs] == [("nice film", "pos"), ("bad film", "neg")]


def test_jsonl_pairs_int_labels_and_drop(tmp_path):
    rows = [
        {"premise": "A man.", "hypothesis": "A person.", "label": 0},
        {"premise": "A cat.", "hypothesis": "A dog.", "label": 2},
        {"premise": "?", "hypothesis": "?", "label": "-"},
        {"premise": "Two.", "hypothesis": "Some.", "label": 1.0},
    ]
    path = _write(tmp_path / "snli.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n")
    exs = read_classification_file(path, drop_labels=["-"])
    assert [(e.text, e.text_pair, e.label, e.line) for e in exs] == [
        ("A man.", "A person.", "0", 1),
        ("A cat.", "A dog.", "2", 2),
        ("Two.", "Some.", "1", 4),
    ]
    array = _write(tmp_path / "arr.json", json.dumps([{"text": "x y", "label": "a"}]))
    assert read_classification_file(array)[0].text == "x y"


def test_long_fields_and_json_array_lines(tmp_path):
    # csv's default 131,072-character field limit had called a long document "malformed"
    long = "word " * 40_000
    for name, sep in (("long.tsv", "\t"), ("long.csv", ",")):
        path = _write(tmp_path / name, f"sentence{sep}label\n{long}{sep}1\nshort{sep}0\n")
        assert [len(e.text) for e in read_classification_file(path)] == [len(long), 5]
    assert csv.field_size_limit() == 131_072  # given back
    # a pretty-printed JSON array: errors name the line the item starts on (it had been the item's number)
    items = [{"text": "a", "label": 1}, {"text": "b", "label": 0}, {"text": "d"}]
    array = _write(tmp_path / "arr.json", json.dumps(items, indent=1))
    with pytest.raises(ValueError, match=r"arr.json', line 10: missing column"):
        read_classification_file(array)
    array = _write(tmp_path / "arr.json", json.dumps(items[:2], indent=1))
    assert [e.line for e in read_classification_file(array)] == [2, 6]


# ----------------------------------------------------------------------------------- label sets, datasets


def test_label_set_order_save_load(tmp_path):
    ints = LabelSet.from_examples(
        read_classification_file(_write(tmp_path / "a.tsv", "sentence\tlabel\na\t10\nb\t2\nc\t-1\n"))
    )
    assert ints.names == ["-1", "2", "10"] and ints.index("10") == 2
    # "1.0" in a text cell is the class of "1", as the number 1.0 is (a CSV mixing them had 3 classes)
    mixed = LabelSet.from_examples(read_classification_file(_write(tmp_path / "m.csv",
                                                                   "sentence,label\na,1.0\nb,1\nc,0\nd,1.\n"
                                                                   "e,01\ng,-0\n")))
    assert mixed.names == ["0", "1"]
    # +1 / -1 keep the order they always had: classifiers trained on them index their classes so
    signs = LabelSet.from_examples(read_classification_file(_write(tmp_path / "s.csv", "sentence,label\na,+1\nb,-1\n")))
    assert signs.names == ["+1", "-1"]
    with pytest.raises(ValueError, match="'\\+1' and '1' are one value spelled two ways"):  # not two classes
        LabelSet.from_examples(read_classification_file(_write(tmp_path / "t.csv", "sentence,label\na,+1\nb,1\n")))
    with pytest.raises(ValueError, match="'\\+01' and '\\+1' are one value spelled two ways"):
        LabelSet.from_examples(read_classification_file(_write(tmp_path / "u.csv", "sentence,label\na,+1\nb,+01\n")))
    strs = LabelSet(["neutral", "entailment"])
    strs.save(tmp_path / "labels.json")
    assert LabelSet.load(tmp_path / "labels.json") == strs
    assert strs.id2label == {0: "neutral", 1: "entailment"} and strs.label2id["entailment"] == 1
    with pytest.raises(ValueError, match="duplicates"):
        LabelSet(["a", "a"])
    with pytest.raises(ValueError, match="not a label-set file"):
        LabelSet.load(_write(tmp_path / "bad.json", "[1, 2]"))


def test_real_valued_scores_are_regression_targets(tmp_path, tok):
    # STS-B: sentence pairs scored 0-5; they had been refused ("regression is not offered")
    head = "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore\n"  # GLUE's
    pre = "0\tmain-captions\tMSRvid\t2012test\t0001\tnone\tnone"

    def tsv(*rows):
        return head + "".join(f"{pre}\t{a}\t{b}\t{y}\n" for a, b, y in rows)

    rows = tsv(("the movie was great", "the plot was bad", "3.800"), ("a film", "what a film", "5"), ("bad", "great", "0.2"))
    train = _write(tmp_path / "train.tsv", rows)
    dev = _write(tmp_path / "dev.tsv", tsv(("the acting", "is terrible", "1.5"), ("not bad", "but", "x")))
    exs = read_classification_file(train)
    labels = labels_of(exs)
    assert isinstance(labels, Scores) and len(labels) == 1 and labels.names == ["score"]
    with pytest.raises(ValueError, match="real-valued scores \\(e.g. '0.2'\\): a regression task"):
        LabelSet.from_examples(exs)  # (a label set of classes would treat the scores as unordered names)
    assert isinstance(labels_of(read_classification_file(_write(tmp_path / "ints.tsv", "sentence\tlabel\na\t1\nb\t0\n"))),
                      LabelSet)
    ds = ClassificationDataset(exs, tok, label_set=labels, max_length=32)
    assert ds.labels == [3.8, 5.0, 0.2]
    batch = ClassificationCollator(tok.pad_id, scores=True)([ds[0], ds[1]])
    assert batch["labels"].dtype == torch.float32 and batch["labels"].tolist() == pytest.approx([3.8, 5.0])
    # the scores are part of the fingerprint that a resumed run checks (as class indices are)
    other = ClassificationDataset(read_classification_file(_write(tmp_path / "t2.tsv", rows.replace("3.800", "3.9"))),
                                  tok, label_set=labels, max_length=32)
    assert other.fingerprint != ds.fingerprint
    # the splits follow the train split's kind; a label that is no number is named by file and line
    with pytest.raises(ValueError, match="dev.tsv', line 3: label 'x' is not a number"):
        load_classification_splits({"train": train, "valid": dev}, tok, max_length=32)
    dev.write_text(tsv(("the acting", "is terrible", "1.5")))
    splits, got = load_classification_splits({"train": train, "valid": dev}, tok, max_length=32)
    assert isinstance(got, Scores) and splits["valid"].labels == [1.5]
    for bad in ("nan", "inf", "1e999"):
        with pytest.raises(ValueError, match="is not a number"):
            Scores().index(bad)


def test_dataset_collate_and_splits(tmp_path, tok):
    train = _write(
        tmp_path / "train.tsv",
        "sentence1\tsentence2\tlabel\nthe movie\twas great\tyes\nthe plot\tbad\tno\nfilm\tacting\tyes\n",
    )
    dev = _write(tmp_path / "dev.tsv", "sentence1\tsentence2\tlabel\nthe film\tterrible\tno\n")
    test = _write(tmp_path / "test.tsv", "sentence1\tsentence2\nwhat a\tfilm\n")
    data, labels = load_classification_splits(
        {"train": train, "valid": dev, "test": test}, tok, max_length=64, label_set_path=tmp_path / "labels.json"
    )
    assert labels.names == ["no", "yes"] and LabelSet.load(tmp_path / "labels.json") == labels
    item = data["train"][0]
    a, b = tok.encode("the movie"), tok.encode("was great")
    assert item["input_ids"].tolist() == [tok.bos_id, *a, tok.eos_id, *b, tok.eos_id] and item["labels"] == 1
    assert "labels" not in data["test"][0]

    collate = ClassificationCollator(tok.pad_id)
    batch = collate([data["train"][i] for i in range(3)])
    lengths = [len(data["train"][i]["input_ids"]) for i in range(3)]
    assert batch["input_ids"].shape == (3, max(lengths))
    assert batch["attention_mask"].sum(1).tolist() == lengths
    assert batch["labels"].tolist() == [1, 0, 1] and batch["labels"].dtype == torch.long
    for row, n in enumerate(lengths):
        assert (batch["input_ids"][row, n:] == tok.pad_id).all()  # right padding
    assert set(collate([data["test"][0]])) == {"input_ids", "attention_mask"}
    with pytest.raises(ValueError, match="some items have labels"):
        collate([data["train"][0], data["test"][0]])
    with pytest.raises(ValueError, match="pad_id"):
        ClassificationCollator(None)
    with pytest.raises(ValueError, match="pad_to must be None or an int >= 1"):  # its error had said max_length
        ClassificationCollator(0, pad_to=0)
    # float ids and labels are refused, naming them (int() had made label 1.7 class 1, id 2.5 id 2)
    with pytest.raises(TypeError, match="labels must hold integers"):
        collate([{"input_ids": [5, 6], "labels": 1.7}])
    with pytest.raises(TypeError, match=r"seqs\[0\] must hold integers"):
        collate([{"input_ids": [5.0, 6.5], "labels": 1}])
    assert collate([{"input_ids": [], "labels": 0}])["input_ids"].shape == (1, 0)  # an empty list is not a float


def test_truncation_and_too_long_error(tmp_path, tok):
    long_text = "the movie was great " * 40
    path = _write(tmp_path / "train.tsv", f"sentence1\tsentence2\tlabel\n{long_text}\tshort one\t1\nok\tfine\t0\n")
    exs = read_classification_file(path)
    labels = LabelSet.from_examples(exs)
    ds = ClassificationDataset(exs, tok, label_set=labels, max_length=32)
    ids = ds[0]["input_ids"].tolist()
    assert len(ids) == 32 and ds.num_truncated == 1
    short = tok.encode("short one")
    assert ids[-len(short) - 1 : -1] == short  # longest-first: the short second text survives intact
    assert ids[0] == tok.bos_id and ids.count(tok.eos_id) == 2
    with pytest.raises(ValueError, match=r"train\.tsv', line 2: \d+ tokens exceed max_length=32"):
        ClassificationDataset(exs, tok, label_set=labels, max_length=32, truncate=False)
    with pytest.raises(ValueError, match="max_length=3 leaves no room"):
        ClassificationDataset(exs, tok, label_set=labels, max_length=3)


# ---------------------------------------------------------------------------------------------- errors


def test_errors(tmp_path, tok):
    train = _write(tmp_path / "train.tsv", "sentence\tlabel\ngood\tpos\nbad\tneg\n")
    dev = _write(tmp_path / "dev.tsv", "sentence\tlabel\nfine\tpos\nmeh\tneutral\n")
    labels = LabelSet.from_examples(read_classification_file(train))
    with pytest.raises(ValueError, match=r"dev\.tsv', line 3: label 'neutral' is not in the label set"):
        ClassificationDataset(read_classification_file(dev), tok, label_set=labels, max_length=16)

    no_label = _write(tmp_path / "train2.tsv", "sentence\trating\ngood\t0.5\n")
    with pytest.raises(ValueError, match=r"train2\.tsv.*no label column.*pass label_column= \(CLI: --label-column\)"):
        read_classification_file(no_label)
    odd = _write(tmp_path / "train3.tsv", "words\tlabel\ngood\t1\n")  # the hint names the CLI flag too
    with pytest.raises(ValueError, match=r"which column holds the text.*text_column= \(CLI: --text-column"):
        read_classification_file(odd)
    with pytest.raises(ValueError, match="label_column='stars' is not a column"):
        read_classification_file(train, label_column="stars")
    assert read_classification_file(no_label, require_labels=False)[0].label is None

    empty_label = _write(tmp_path / "e.tsv", "sentence\tlabel\ngood\t\n")
    with pytest.raises(ValueError, match="line 2: empty label"):
        read_classification_file(empty_label)
    short_row = _write(tmp_path / "s.tsv", "sentence\tlabel\ngood\n")
    with pytest.raises(ValueError, match=r"line 2: missing column\(s\) \['label'\]"):
        read_classification_file(short_row)
    assert (
        read_classification_file(_write(tmp_path / "s2.tsv", "sentence\tlabel\ngood\nok\t1\n"), skip_bad_rows=True)[
            0
        ].text
        == "ok"
    )
    no_text = _write(tmp_path / "n.tsv", "foo\tlabel\nx\t1\n")
    with pytest.raises(ValueError, match="which column holds the text"):
        read_classification_file(no_text)
    with pytest.raises(ValueError, match="file is empty"):
        read_classification_file(_write(tmp_path / "empty.tsv", ""))
    bad_utf8 = tmp_path / "bad.tsv"
    bad_utf8.write_bytes(b"sentence\tlabel\ncaf\xe9\t1\n")
    with pytest.raises(ValueError, match=r"bad\.tsv.*invalid UTF-8 at byte offset 18"):
        read_classification_file(bad_utf8)
    bad_json = _write(tmp_path / "b.jsonl", '{"text": "a", "label": 1}\n{"text": oops}\n')
    with pytest.raises(ValueError, match=r"b\.jsonl', line 2: invalid JSON"):
        read_classification_file(bad_json)
    with pytest.raises(FileNotFoundError, match="missing.tsv"):
        read_classification_file(tmp_path / "missing.tsv")
    with pytest.raises(ValueError, match="cannot tell the format"):
        read_classification_file(_write(tmp_path / "x.parquet", "a"))
    with pytest.raises(ValueError, match="max_length"):
        ClassificationDataset(read_classification_file(train), tok, label_set=labels, max_length=0)
    with pytest.raises(ValueError, match="label_set"):
        ClassificationDataset(read_classification_file(train), tok, label_set=None, max_length=16)


def test_a_row_with_extra_fields_is_a_bad_row(tmp_path):
    """A tab inside a TSV text shifts the cells: the label would be a word of the text."""
    f = _write(tmp_path / "train.tsv", "sentence\tlabel\nhello world\t1\ntext with\ttab\t1\nfoo bar\t0\n")
    with pytest.raises(ValueError, match=r"line 3: 3 fields, expected 2"):
        read_classification_file(f)
    assert [e.label for e in read_classification_file(f, skip_bad_rows=True)] == ["1", "0"]
    trailing = _write(tmp_path / "trailing.tsv", "sentence\tlabel\nhello world\t1\t\n")  # an empty extra cell
    assert [e.label for e in read_classification_file(trailing)] == ["1"]


def test_headerless_first_row_with_a_known_name_is_data(tmp_path):
    # "text<TAB>1": "text" names a known column, but a row holding a number is data, not a header
    rows = read_classification_file(_write(tmp_path / "h.tsv", "text\t1\nanother one\t0\n"),
                                    text_column=0, label_column=1)
    assert [(r.text, r.label) for r in rows] == [("text", "1"), ("another one", "0")]
    named = read_classification_file(_write(tmp_path / "n.tsv", "text\tlabel\nan example\t1\n"))
    assert [(r.text, r.label) for r in named] == [("an example", "1")]


@pytest.mark.parametrize("suffix,sep", [(".tsv", "\t"), (".csv", ",")])
def test_an_unknown_header_is_not_read_as_an_example(tmp_path, suffix, sep):
    # "tweet<TAB>sentiment" names no known column: it was example 1, and "sentiment" a third class
    text = sep.join(("tweet", "sentiment")) + "\n" + "".join(
        f"{t}{sep}{y}\n" for t, y in (("great day", 1), ("awful day", 0), ("nice one", 1)))
    path = _write(tmp_path / f"tw{suffix}", text)
    with pytest.raises(ValueError, match=r"line 1: label 'sentiment' looks like a column name .*--header yes/no"):
        read_classification_file(path, text_column=0, label_column=1)
    assert [e.label for e in read_classification_file(path, text_column=0, label_column=1, has_header=False)] == \
        ["sentiment", "1", "0", "1"]  # as told
    named = read_classification_file(path, text_column="tweet", label_column="sentiment")  # names: a header
    assert [e.label for e in named] == ["1", "0", "1"]
    words = _write(tmp_path / f"w{suffix}", text.replace(f"{sep}1\n", f"{sep}pos\n").replace(f"{sep}0\n", f"{sep}neg\n"))
    assert len(read_classification_file(words, text_column=0, label_column=1)) == 4  # a class seen once: no telling
    # word labels each seen twice or more, a one-word text beside the odd label: a header (had been a class)
    more = words.read_text() + f"bad one{sep}neg\n"
    words.write_text(more)
    with pytest.warns(UserWarning, match=r"label 'sentiment' is in no other row .* --header yes"):
        assert len(read_classification_file(words, text_column=0, label_column=1)) == 5  # said, not refused
    assert len(read_classification_file(words, text_column=0, label_column=1, has_header=False)) == 5
    assert len(read_classification_file(words, text_column=0, label_column=1, has_header=True)) == 4
    # a first example of several words is an example, whatever its label
    words.write_text(more.replace("tweet", "a first tweet", 1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(read_classification_file(words, text_column=0, label_column=1)) == 5


def test_training_rows_need_labels_whatever_the_file_is_called(tmp_path):
    """A training file named like sst_test.tsv made labels optional: an empty label passed loading and
    failed steps later ("some items have labels and some do not"), naming no file."""
    import contextlib

    from transnormer.train.distributed import DistInfo
    from transnormer.train.loop import TrainConfig
    from transnormer.train.tasks import build_task_data

    rows = "".join(f"word{i} other{i % 3}\t{i % 2}\n" for i in range(30))
    path = _write(tmp_path / "sst_test.tsv", "sentence\tlabel\n" + rows + "an unlabelled row\t\n")
    cfg = TrainConfig(task="cls", data=str(path), vocab_size=300, seq_len=16, max_steps=1,
                      cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match=r"sst_test.tsv', line 32: empty label in column 'label'"):
        build_task_data(cfg, DistInfo(), contextlib.nullcontext)


def test_cli_words_in_the_reading_errors(tmp_path):
    # the messages had named Python arguments (skip_bad_rows=True, truncate=True) a CLI user cannot pass
    path = _write(tmp_path / "bad.tsv", "sentence\tlabel\na b\t1\nc\td\t0\n")
    with pytest.raises(ValueError, match=r"--skip-bad-rows"):
        read_classification_file(path)
    assert [e.text for e in read_classification_file(path, skip_bad_rows=True)] == ["a b"]
    with pytest.raises(ValueError, match=r"--text-pair-column\) given without text_column \(--text-column\)"):
        read_classification_file(path, text_pair_column="sentence")


def test_pair_truncation_matches_the_fast_tokenizers_longest_first():
    # the first text had kept the odd token of an even split, where the saved tokenizer (HF pipelines)
    # gives it to the longer text, the second on a tie: a one-token train/serve skew
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    from transnormer.data.classification import _truncate_lengths

    tok = Tokenizer(WordLevel({"w": 0, "[UNK]": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = WhitespaceSplit()
    for budget in (1, 2, 5, 6, 9):
        tok.enable_truncation(max_length=budget, strategy="longest_first")
        for la in range(1, 12):
            for lb in range(1, 12):
                enc = tok.encode(" ".join(["w"] * la), " ".join(["w"] * lb), add_special_tokens=False)
                theirs = (enc.sequence_ids.count(0), enc.sequence_ids.count(1))
                assert _truncate_lengths(la, lb, budget) == theirs, (la, lb, budget)


def test_score_files_with_a_bad_score_empty_json_and_unlabelled_train_files_are_named(tmp_path):
    import contextlib

    from transnormer.train.distributed import DistInfo
    from transnormer.train.loop import TrainConfig, name_classes
    from transnormer.train.tasks import build_task_data

    # one "NaN" among STS-B-like scores had made a classifier of one class per score value
    rows = "".join(f"a{i} b\tc{i} d\t{i % 5 + 0.25 * (i % 4)}\n" for i in range(20))
    sts = _write(tmp_path / "sts.tsv", "sentence1\tsentence2\tscore\n" + rows + "e f\tg h\tNaN\n")
    with pytest.raises(ValueError, match=r"sts.tsv', line 22: label 'NaN' is not a number, while the other labels "
                                         r"are real-valued scores .*--drop-label NaN"):
        labels_of(read_classification_file(sts))
    assert isinstance(labels_of(read_classification_file(sts, drop_labels=["NaN"])), Scores)
    # classes named by decimals beside a word class of many rows stay classes
    classes = _write(tmp_path / "dec.tsv", "sentence\tlabel\n" + "".join(
        f"good {i}\t0.5\nbad {i}\t1.5\nok {i}\tneutral\n" for i in range(12)))
    assert labels_of(read_classification_file(classes)).names == ["0.5", "1.5", "neutral"]
    # an empty JSON array: "cannot tell which column holds the text (columns: [])"
    with pytest.raises(ValueError, match="no records"):
        read_classification_file(_write(tmp_path / "e.json", "[]\n"))
    # columns are read from the records that have some (100 leading {} had left none)
    lead = _write(tmp_path / "lead.jsonl", "{}\n" * 100 + "".join(
        json.dumps({"sentence": f"w {i}", "label": i % 2}) + "\n" for i in range(4)))
    assert len(read_classification_file(lead, skip_bad_rows=True)) == 4
    # a train file without labels was told "or require_labels=False", which no CLI flag sets
    folder = tmp_path / "nolab"
    folder.mkdir()
    _write(folder / "train.tsv", "sentence\tother\nfoo bar\tx\nbaz qux\ty\n")
    cfg = TrainConfig(task="cls", data=str(folder), vocab_size=300, seq_len=16, max_steps=1,
                      cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="no label column") as err:
        build_task_data(cfg, DistInfo(), contextlib.nullcontext)
    assert "require_labels" not in str(err.value)

    # --set problem_type against class labels had failed at the first step, naming label shapes
    from transnormer.presets import build_model

    model = build_model("t2-roberta-tiny", num_labels=2, problem_type="regression", task="cls")
    with pytest.raises(ValueError, match="the labels decide it .* leave problem_type out"):
        name_classes(model, LabelSet(["0", "1"]))
