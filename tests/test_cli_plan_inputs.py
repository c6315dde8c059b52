"""Plan-file and option inputs that used to be accepted in silence: `train --plan` with `--budget`, an empty
`--topology`, a plan file with a key given twice."""
import json

from test_cli_inputs import run_main


def _plan(tmp_path):
    p = tmp_path / "p.json"
    code, err = run_main(["plan", "--model", "tiny", "--seq", "16", "--world", "1", "--out", str(p)])
    assert code == 0, err
    return p


def test_train_plan_honours_budget(tmp_path):
    p, log = _plan(tmp_path), tmp_path / "log.json"
    code, err = run_main(["train", "--model", "tiny", "--seq", "16", "--plan", str(p), "--budget", "1", "--steps", "1",
                          "--log", str(log)])
    assert code == 3 and "predicted out of memory" in err and "the budget is 1 B" in err, err
    assert len(err.strip().splitlines()) == 1 and not log.exists()


def test_empty_topology_refused():
    code, err = run_main(["plan", "--model", "tiny", "--topology", ""])
    assert code == 2 and "--topology is empty" in err and len(err.strip().splitlines()) == 1, err


def test_plan_file_with_a_key_twice_refused(tmp_path):
    p = _plan(tmp_path)
    text = p.read_text()
    p.write_text(text[:text.rindex("}")] + ', "name": "twice"}')
    code, err = run_main(["train", "--model", "tiny", "--seq", "16", "--plan", str(p), "--steps", "1",
                          "--log", str(tmp_path / "log.json")])
    assert code == 2 and 'key "name" appears twice' in err and len(err.strip().splitlines()) == 1, err


def test_plan_budget_beyond_the_device_refused(tmp_path):
    "A budget larger than one device of the topology is refused; without --budget the plan is searched under all of it."
    from dataclasses import replace
    from static_dist.topology import preset
    topo = tmp_path / "small.json"
    replace(preset("cluster", n_nodes=1, gpus_per_node=1), device_memory=2**30).save(topo)
    code, err = run_main(["plan", "--model", "tiny", "--seq", "16", "--world", "1", "--topology", str(topo),
                          "--budget", "900GiB"])
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "--budget 900.00 GiB is more than one H100-SXM of the topology holds (1.00 GiB)" in err, err
    p = tmp_path / "p.json"
    code, err = run_main(["plan", "--model", "tiny", "--seq", "16", "--world", "1", "--topology", str(topo),
                          "--out", str(p)])
    assert code == 0, err


def test_plan_default_budget_is_the_device_memory(capsys):
    "An H100 holds the 81,559 MiB its driver reports (nvidia-smi), the default budget of a plan on H100 nodes."
    from static_dist.app.cli import main
    assert main(["plan", "--model", "tiny", "--seq", "16", "--world", "1"]) == 0
    assert "budget 79.65 GiB" in capsys.readouterr().out
