"""The LCM's reaper (services/lcm/manager.py) sleeps until a child exits instead of polling
every 50 ms (issue #16: the daemon woke 20 times a second for it, idle or not): a guardian's
exit is still reported with its code, and once the LCM has stopped its reaper takes no
exit code from children its process still waits for. Run in a child interpreter of its
own: a reaper reaps every child of its process, and this one's children include the test
servers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

SCRIPT = r"""
import json, subprocess, sys, tempfile, time
from pathlib import Path
from contract import procs
from services.lcm.manager import LcmConfig, LifecycleManager

procs.become_subreaper()  # as the LCM makes its daemon
config = LcmConfig(Path(tempfile.mkdtemp()), "http://127.0.0.1:9", "mongodb://127.0.0.1:9")
lcm = LifecycleManager(config, None, None)  # only its reaper is used here
rounds = [0]
reap_once = lcm.reaper.reap_once


def counted():
    rounds[0] += 1
    reap_once()


lcm.reaper.reap_once = counted
lcm.reaper.start()


def until(what, done, limit_s=30.0):
    deadline = time.monotonic() + limit_s
    while not done():
        if time.monotonic() > deadline:
            sys.exit(f"timed out waiting for {what}")
        time.sleep(0.01)


codes = {}
sleep = "import sys, time; time.sleep(float(sys.argv[1])); sys.exit(int(sys.argv[2]))"
# a long-lived child (a guardian host): the reaper's thread sleeps in waitid meanwhile
host = subprocess.Popen([sys.executable, "-c", sleep, "60", "0"])
lcm.reaper.watch(host.pid, lambda pid, code: None)
# a guardian-like child that runs for a second, watched as the LCM watches its guardians
guardian = subprocess.Popen([sys.executable, "-c", sleep, "1.0", "7"])
lcm.reaper.watch(guardian.pid, lambda pid, code: codes.__setitem__("guardian", code))
until("the guardian's exit", lambda: "guardian" in codes)
rounds_for_one_exit = rounds[0]

# stopped (as LifecycleManager.stop does), its thread may still sleep in waitid: children
# this process waits for itself keep their exit codes
lcm.reaper.stop()
after_stop = []
for _ in range(3):
    child = subprocess.Popen([sys.executable, "-c", sleep, "0", "5"])
    time.sleep(0.5)  # it has exited and woken the reaper's thread before we wait for it
    after_stop.append(child.wait())
host.kill()
print(json.dumps({"codes": codes, "rounds_for_one_exit": rounds_for_one_exit,
                  "after_stop": after_stop, "rounds_after_stop": rounds[0] - rounds_for_one_exit}))
"""


def test_the_lcm_reaper_reports_a_guardian_exit_without_polling_and_stops_reaping() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["codes"] == {"guardian": 7}
    # a second with one child running: a poll every 50 ms reaped ~20 times; now the exit
    # wakes it (the first watch may add one round)
    assert got["rounds_for_one_exit"] <= 2, got
    assert got["after_stop"] == [5, 5, 5], got
    assert got["rounds_after_stop"] == 0, got
