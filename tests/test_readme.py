"""The README's Python examples run as written (against a real agent), so they stay true."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from hixl.processes import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def python_blocks() -> list[str]:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)


def test_readme_examples_run(agent_process, tmp_path) -> None:
    from hixl.tools.daemons import MasterProcess

    blocks = python_blocks()
    assert len(blocks) >= 5, "the README lost its usage examples"
    node = agent_process(config={"pool_max_bytes": "64MiB"})
    server_name = f"127.0.0.1:{free_port()}"
    with MasterProcess(extra=["--data-dir", str(tmp_path / "master")]) as master:
        # the quickstart's two nodes: agents publishing to the master (on this host)
        node1, node2 = (agent_process(config={"master": master.target}) for _ in range(2))
        outputs = run_blocks(blocks, {"10.0.0.1:50051": master.target, "10.0.0.1:50161": node1.engine,
                            "10.0.0.2:50161": node2.engine, "10.0.0.1": "127.0.0.1",
                            "127.0.0.1:50161": node.engine, "127.0.0.1:50162": server_name,
                            "127.0.0.1:50051": master.target})
    # the HIXL-shaped example's async READ reports how it ended (its first status seen
    # finished is the only one: asking again is PARAM_INVALID)
    assert any("READ COMPLETED\n" in out for out in outputs), outputs


def run_blocks(blocks: list[str], addresses: dict[str, str]) -> list[str]:
    """Run each example in its own interpreter, its fixed addresses pointed at ours; an
    example that says it runs under `hixl shmem-run -n N` runs as N PEs that way. Returns
    each example's stdout."""
    outputs = []
    for block in blocks:
        code = block
        for fixed, ours in addresses.items():
            code = code.replace(fixed, ours)
        argv = [sys.executable, "-c", code]
        launcher = re.search(r"hixl shmem-run -n (\d+)", block)
        if launcher:
            argv = [sys.executable, "-m", "hixl.tools.cli", "shmem-run", "-n",
                    launcher.group(1), "--timeout", "100", "--", *argv]
        result = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, \
            f"README example failed:\n{block}\n{result.stderr}{result.stdout}"
        outputs.append(result.stdout)
    return outputs
