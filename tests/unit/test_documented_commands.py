"""Every command of ours that README.md and docs/ show still works.

Each ```bash line that starts one of our tools (run_hetseq.py, run_hyper.py,
run_multi_seed.py, `textbox-like X`, `python -m textbox_like.X`, also behind
torchrun, `accelerate launch`, srun or a `nodeA$` prompt) is read as a shell
would (continuations, comments, `$OPTS`), its placeholders (DIR, `...`, data
folders) given tiny local stand-ins, and then:

- the trainer's options (whatever launches it) resolve and pass the run's
  checks, as `run_hetseq.py` does before it loads anything; a search's or a
  seed run's own options parse, its space file loads and the trainer options it
  hands every trial resolve; the tools' (bench, prepare_bert, eval, plot,
  export) options parse;
- the documented one-process MNIST commands train for real, in this process,
  their fast equivalent (a tiny MNIST, a few updates), and the eval, plot and
  restore commands that follow them read what they wrote.

Launchers themselves are the integration tier's subject (torchrun, accelerate
launch, srun tasks and file:// nodes in tests/integration/test_distributed.py,
test_user_code_everywhere_processes.py, test_elastic_processes.py).
"""
import json
import re
import shlex
from pathlib import Path

import pytest

from conftest import run_main, write_mnist

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
SCRIPTS = {"run_hetseq.py": "train", "run_hyper.py": "hyper", "run_multi_seed.py": "multi-seed"}
MODULES = {"textbox_like.tools.prepare_bert": "prepare-bert", "textbox_like.tools.eval": "eval",
           "textbox_like.metrics.plot": "plot", "textbox_like.tools.bench": "bench", "textbox_like.tools.export": "export"}


def shell_lines(text):
    """The command lines of a page's bash blocks, continuations joined, `$VAR`s
    set in the same block expanded, one entry per `&&`-joined command."""
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        variables = {}
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            words = shlex.split(line, comments=True)
            if not words:
                continue
            if len(words) == 1 and re.match(r"^[A-Z_]+=", words[0]):
                name, value = words[0].split("=", 1)
                variables[name] = value
                continue
            expanded = []
            for word in words:
                expanded += shlex.split(variables[word[1:]]) if word[1:] in variables else [word]
            command = []
            for word in expanded + ["&&"]:
                if word in ("&&", "&", ";"):
                    if command:
                        yield command
                    command = []
                else:
                    command.append(word)


def invocation(words):
    """(our tool, its argv) of a command line, or None where it starts none of ours."""
    words = [w for w in words if not re.match(r"^\w+\$$", w) and not re.match(r"^[A-Z_]+=", w)]
    if ">" in words:
        words = words[:words.index(">")]
    for i, word in enumerate(words):
        name = Path(word).name
        if name in SCRIPTS:
            return SCRIPTS[name], words[i + 1:]
        if word == "textbox-like":
            return words[i + 1], words[i + 2:]
        if word == "-m" and words[i + 1] in MODULES:
            return MODULES[words[i + 1]], words[i + 2:]
    return None


def documented():
    found = []
    for page in PAGES:
        for words in shell_lines(page.read_text()):
            call = invocation(words)
            if call:
                found.append((page.name, shlex.join(words), *call))
    return found


DOCUMENTED = documented()


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory):
    """Local stand-ins for the pages' placeholders: folders and files that exist."""
    base = tmp_path_factory.mktemp("documented")
    mnist = base / "mnist"
    write_mnist(mnist, n_train=64, n_test=16, seed=3)
    vocab = base / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(59)]) + "\n")
    bert = base / "bert128"
    bert.mkdir()
    from textbox_like.data.bert_hdf5 import write_shard
    from test_bert_data import make_arrays
    for name, seed in (("bert_train_0.hdf5", 0), ("bert_test_0.hdf5", 1)):
        write_shard(bert / name, make_arrays(8, seed), chunk_rows=4)
    (base / "bert_config.json").write_text(json.dumps({"hidden_size": 32, "num_attention_heads": 2,
                                                       "num_hidden_layers": 1, "intermediate_size": 64,
                                                       "vocab_size": 64}))
    text = base / "my_text"
    text.mkdir()
    (text / "train.txt").write_text("a b c\n")
    (base / "space.test").write_text("learning_rate choice [0.01, 0.1]\n")
    (base / "space.txt").write_text("spiral_width choice [16, 64]\n")   # what your-own-model.md echoes into it
    models = {}
    for name, config in {"my_gpt2": {"model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 16, "vocab_size": 64,
                                     "architectures": ["GPT2LMHeadModel"]},
                         "bart": {"model_type": "bart", "encoder_layers": 1, "decoder_layers": 1, "d_model": 16,
                                  "encoder_attention_heads": 2, "decoder_attention_heads": 2, "vocab_size": 64,
                                  "architectures": ["BartForConditionalGeneration"]}}.items():
        models[name] = base / name
        models[name].mkdir()
        (models[name] / "config.json").write_text(json.dumps(config))
    return {"my_gpt2/": str(models["my_gpt2"]), "my_gpt2": str(models["my_gpt2"]),
            "facebook/bart-base": str(models["bart"]), "my.yaml": str(base / "my.yaml"),
            "DIR": str(mnist), "~/data/mnist": str(mnist), "../shared/data/mnist": str(mnist),
            "data/bert128": str(bert), "../shared/data/bert/vocab.txt": str(vocab), "vocab.txt": str(vocab),
            "bert_config.json": str(base / "bert_config.json"), "my_text/": str(text), "my_text": str(text),
            "news/": str(text), "space.test": str(base / "space.test"),
            "space.txt": str(base / "space.txt")}


def placed(argv, stand_ins):
    """argv with its placeholders replaced (also as `--opt=VALUE`), folders of this
    repository made absolute, its optional `[...]` parts dropped; a line whose
    options the page elides (`...`) gets a length, as the run it stands for has."""
    out = []
    for word in argv:
        if word == "..." or (word.startswith("[") and word.endswith("]")):
            continue
        option, equals, value = word.partition("=") if word.startswith("--") and "=" in word else ("", "", word)
        value = stand_ins.get(value, value)
        for folder in ("properties/", "examples/"):
            if value.startswith(folder):
                value = f"{ROOT}/{value}"
        out.append(f"{option}={value}" if equals else value)
    if "..." in argv and not {"--max-update", "--max-epoch"} & set(out):
        out += ["--max-update", "1"]
    if "..." in argv and "bert" in out and "--data" not in out:
        out += ["--data", stand_ins["data/bert128"], "--dict", stand_ins["vocab.txt"]]
    return out


def test_the_pages_show_every_tool_and_many_trainer_commands():
    tools = {tool for _, _, tool, _ in DOCUMENTED}
    assert tools == {"train", "hyper", "multi-seed", "prepare-bert", "eval", "plot", "bench", "export"}
    assert sum(tool == "train" for _, _, tool, _ in DOCUMENTED) >= 40


TRAINER = [(page, line, argv) for page, line, tool, argv in DOCUMENTED if tool == "train"]


@pytest.mark.parametrize("page,line,argv", TRAINER, ids=[f"{p}:{' '.join(a)[:60]}" for p, _, a in TRAINER])
def test_a_documented_trainer_command_resolves_and_passes_the_runs_checks(page, line, argv, stand_ins, tmp_path,
                                                                          monkeypatch):
    from textbox_like.resolve.checks import check
    from textbox_like.resolve.resolution import resolve
    monkeypatch.chdir(tmp_path)     # relative --save-dir and my.yaml land here
    argv = placed(argv, stand_ins)
    if "--config" in argv:          # the page wrote it with --print_config first
        cfg, _ = resolve(["--task", "mnist"])
        from textbox_like.config.files import to_yaml
        Path(argv[argv.index("--config") + 1]).write_text(to_yaml(cfg))
    cfg, _ = resolve(argv)
    check(cfg)


SEARCHES = [(page, line, tool, argv) for page, line, tool, argv in DOCUMENTED if tool in ("hyper", "multi-seed")]


@pytest.mark.parametrize("page,line,tool,argv", SEARCHES, ids=[f"{p}:{' '.join(a)[:60]}" for p, _, _, a in SEARCHES])
def test_a_documented_search_parses_loads_its_space_and_its_trials_options_resolve(page, line, tool, argv,
                                                                                 stand_ins, monkeypatch, tmp_path):
    from textbox_like.resolve.checks import check
    from textbox_like.resolve.resolution import import_plugins, resolve
    from textbox_like.resolve.options import build_options
    from textbox_like.search.commands import parse_search
    from textbox_like.search.space import load_space
    monkeypatch.chdir(tmp_path)
    argv = placed(argv, stand_ins)
    if tool == "hyper" and not any(a.startswith("--space") for a in argv):
        argv += ["--space", stand_ins["space.test"], "--task", "mnist"]   # a line that elides the search's options
    search, rest = parse_search("run_hyper.py" if tool == "hyper" else "run_multi_seed.py", argv)
    if tool == "hyper":
        import_plugins(rest)
        assert load_space(search.space, build_options())
    cfg, _ = resolve(rest + ["--save-dir", str(tmp_path / "trial")])
    check(cfg)


TOOLS = [(page, line, tool, argv) for page, line, tool, argv in DOCUMENTED if tool in ("bench", "prepare-bert", "export")]


@pytest.mark.parametrize("page,line,tool,argv", TOOLS, ids=[f"{p}:{' '.join(a)[:60]}" for p, _, _, a in TOOLS])
def test_a_documented_tools_options_parse(page, line, tool, argv, stand_ins):
    argv = placed(argv, stand_ins)
    if tool == "bench":
        from textbox_like.tools.bench import build_parser
    elif tool == "prepare-bert":
        from textbox_like.tools.prepare_bert import build_parser
    else:
        from textbox_like.tools.export import build_parser
    args, rest = build_parser().parse_known_args(argv)
    assert tool != "prepare-bert" or not rest, rest


def test_the_documented_one_process_mnist_commands_train_restore_evaluate_and_plot(stand_ins, tmp_path, monkeypatch,
                                                                                  capsys):
    """getting-started.md's and faults.md's commands, their fast equivalents,
    one after another as a user types them: train, print the configuration and
    feed it back, keep interval checkpoints and resume, restore a checkpoint
    into a new run with another LR, evaluate it, plot both runs."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TEXTBOX_LIKE_CURVES", "0")
    fast = ["--data", stand_ins["DIR"], "--max-sentences", "16", "--log-format", "none"]
    pages = {line for page, line, _, _ in DOCUMENTED if page in ("getting-started.md", "faults.md")}
    hetseq = next(line for line in pages if "--optimizer adadelta" in line)
    assert "--fast-stat-sync" in hetseq
    argv = placed(shlex.split(hetseq)[2:], stand_ins)
    argv[argv.index("--save-dir") + 1] = "hetseq"
    assert run_main(argv + fast[2:] + ["--max-update", "3", "--num-workers", "0"]) == 0

    first = "python run_hetseq.py --task mnist --save-dir out --save-interval-updates 200 --keep-interval-updates 2"
    assert first in pages and first + " --resume" in pages
    short = ["--save-interval-updates", "2", "--keep-interval-updates", "2", "--max-epoch", "9"]
    assert run_main(["--task", "mnist", "--save-dir", "out", *short, *fast, "--max-update", "4"]) == 0
    assert run_main(["--task", "mnist", "--save-dir", "out", *short, *fast, "--max-update", "6", "--resume"]) == 0
    assert json.loads(Path("out/results.json").read_text())["num_updates"] == 6
    kept = sorted(p.name for p in Path("out").glob("checkpoint_*_*.pt"))
    assert kept == ["checkpoint_1_2.pt", "checkpoint_2_6.pt"], kept   # every 2 updates (4: the epoch's)
    restore = next(line for line in pages if "--restore-file" in line)
    argv = shlex.split(restore)[2:]
    argv[argv.index("--restore-file") + 1] = "out/checkpoint_1_2.pt"
    assert run_main(argv + fast + ["--max-update", "6"]) == 0
    config = Path("out2/config.yaml").read_text()
    assert "0.001" in config and "checkpoint_1_2.pt" in config

    evaluate = next(line for line in pages if "textbox_like.tools.eval" in line)
    argv = shlex.split(evaluate)[3:]
    argv[argv.index("--model_ckpt") + 1] = "out/checkpoint_best.pt"
    from textbox_like.tools.eval import main as eval_main
    capsys.readouterr()
    assert eval_main(argv + ["--data", stand_ins["DIR"]]) == 0
    assert "accuracy" in capsys.readouterr().out

    plot = next(line for line in pages if "textbox_like.metrics.plot runs/lr1" in line)
    argv = [{"runs/lr1": "out", "runs/lr2": "out2"}.get(a, a) for a in shlex.split(plot)[3:]]
    from textbox_like.metrics.plot import main as plot_main
    assert plot_main(argv) == 0 and Path("cmp.png").stat().st_size > 1000
