"""--print_config shows the model a BERT preset builds (sizes resolved from
properties/model/); the trainer's main in-process."""
import yaml

from conftest import refusal_in_process


def test_preset_sizes_printed_and_overrides_win(capfd):
    def printed(*args):
        out = refusal_in_process(["--task", "bert", *args, "--print_config"], capfd)
        assert out.returncode == 0, out.stderr
        return yaml.safe_load(out.stdout)

    tiny = printed("--model-preset", "tiny")
    assert (tiny["dimension"], tiny["num_heads"], tiny["num_layers"], tiny["dim_feedforward"]) == (128, 2, 2, 512)
    small = printed("--model-preset", "tiny", "--dimension", "64")
    assert (small["dimension"], small["dim_feedforward"], small["num_layers"]) == (64, 256, 2)
    base = printed()
    assert (base["dimension"], base["num_layers"]) == (768, 12)
