"""Labels are checked, not guessed (issue 51, item 5): a csv row without a
label is one line naming the sample (it trained a third class named 'None',
or, in one split only, got a wrong message about names and numbers); a label
outside the classes the model's trained head has is one line naming the
sample and the value (it silently replaced a 2-class head with a 6-class
one); --new_head trains a new head on purpose, and the start line says so,
as it does for a model without a trained classification head. The trainer's
main in-process, on tiny models and csv files written here."""
from __future__ import annotations

import pytest

from conftest import refusal_in_process
from test_hf_task import write_model

TEXTS = ["the cat sees a dog", "a big red fish", "the small bird runs", "a very good tree", "the blue cat eats",
         "a bad dog likes fish", "the tree and bird", "quite a small cat"]


def csv_data(tmp_path, train_labels, valid_labels):
    directory = tmp_path / "data"
    directory.mkdir()
    for split, labels in (("train", train_labels), ("valid", valid_labels)):
        rows = [f'"{TEXTS[i % len(TEXTS)]}",{"" if label is None else label}' for i, label in enumerate(labels)]
        (directory / f"{split}.csv").write_text("text,label\n" + "\n".join(rows) + "\n")
    return directory


def run(model, data, tmp_path, capfd, *extra):
    return refusal_in_process(["--task", "hf", "--model_name_or_path", model, "--data", data, "--save-dir",
                               tmp_path / "run", "--max-sentences", 4, "--max-update", 2, "--log-format", "simple",
                               "--cpu", *extra], capfd)


def error_line(out):
    lines = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert out.returncode == 2 and len(lines) == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    return lines[0]


def start_line(out):
    assert out.returncode == 0, out.stderr[-3000:]
    return next(line for line in out.stderr.splitlines() if line.startswith("task hf |"))


@pytest.fixture(scope="module")
def trained_two_class_model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("cls") / "model", "sequence_classification")


@pytest.mark.parametrize("split", ["train", "valid"])
def test_a_sample_without_a_label_is_one_line_naming_it(trained_two_class_model, tmp_path, capfd, split):
    labels = [0, 1, 0, 1, 0, 1, 0, 1]
    missing = [0, 1, 0, None, 0, 1, 0, 1]
    data = csv_data(tmp_path, missing if split == "train" else labels, missing if split == "valid" else labels)
    line = error_line(run(trained_two_class_model, data, tmp_path, capfd))
    assert line == (f"error: sample 3 of the {split!r} split has no label (--label_column 'label' is empty there); "
                    f"give every sample a label, or remove that one")


def test_a_label_outside_the_trained_heads_classes_is_one_line_and_new_head_trains_one(trained_two_class_model,
                                                                                       tmp_path, capfd):
    data = csv_data(tmp_path, [0, 1, 0, 1, 5, 1, 0, 1], [0, 1, 0, 1])
    line = error_line(run(trained_two_class_model, data, tmp_path, capfd))
    assert line == (f"error: sample 4 of the 'train' split has label 5, not one of the 2 classes the model's trained "
                    f"head has (0, 1; {trained_two_class_model}/config.json); fix the label, or pass --new_head to "
                    f"train a new head of the data's classes")
    assert not (tmp_path / "run").exists()
    said = start_line(run(trained_two_class_model, data, tmp_path, capfd, "--new_head"))
    assert "| new classification head: 6 classes (the model's trained head of 2 dropped: --new_head) |" in said + " |"


def test_labels_within_the_trained_head_keep_it_and_a_model_without_one_says_its_head_is_new(
        trained_two_class_model, tmp_path, capfd):
    data = csv_data(tmp_path, [0, 1, 0, 1, 0, 1, 0, 1], [0, 1])
    assert "new classification head" not in start_line(run(trained_two_class_model, data, tmp_path, capfd))
    untrained = write_model(tmp_path / "config_only", "sequence_classification", weights=False)
    said = start_line(run(untrained, data, tmp_path, capfd, "--save-dir", tmp_path / "run2"))
    assert "| new classification head: 2 classes |" in said + " |"


def test_a_csv_row_with_too_many_fields_is_our_one_line_alone(tmp_path, capfd):
    """datasets' csv builder logs "Failed to read file ... with error ..."
    before it raises: that line came first, then ours with the same words.
    The whole of stderr is now the one error line."""
    model = write_model(tmp_path / "model", "sequence_classification")
    data = csv_data(tmp_path, [0, 1, 0, 1], [0, 1])
    (data / "train.csv").write_text('text,label\n"the cat sees a dog",1\n"a big red fish",0,3,4,5\n')
    out = run(model, data, tmp_path, capfd)
    assert error_line(out) == (f"error: {str(data / 'train.csv')!r} could not be read as csv: Error tokenizing "
                               f"data. C error: Expected 2 fields in line 3, saw 5")
    assert out.stderr.strip().splitlines() == [error_line(out)], out.stderr
