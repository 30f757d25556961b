"""A failover suite as a user of the testbed writes it: copy this file next to your own tests.

Run it as root:  sudo .venv/bin/python -m pytest examples/
The `nezha_testbed` pytest plugin (installed with the package) provides the fixtures.
"""
import pytest

from testbed.run import probes

TWO_RAILS = """
name: my-two-rails
hosts: 3
rails:
  - {name: r0, bandwidth: 200mbit}
  - {name: r1, bandwidth: 200mbit}
tcp: {rto_min: 5ms}
"""


@pytest.mark.needs_netns
@pytest.mark.topology(TWO_RAILS)
def test_a_rail_failure_cuts_only_that_rail(fabric):
    fabric.target("h2.r1").set_state(False)          # the fault API: link, rail or host
    assert not probes.reachable(fabric, "h1", "h2", "r1")
    assert probes.reachable(fabric, "h1", "h2", "r0")


@pytest.mark.needs_netns
def test_my_allreduce_survives_a_rail_failure_within_200ms(testbed_run):
    outcome = testbed_run(TWO_RAILS + """
workload: {kind: allreduce, size: 4MiB, duration: 8s}
faults: [{at: 3s, action: link-down, target: h2.r1, for: 3s}]
expect:
  wrong_results: 0
  iterations_lost: 0
  failover_ms: {max: 200}
""")
    assert outcome.passed, outcome.verdict.failures


@pytest.mark.needs_netem
@pytest.mark.topology(TWO_RAILS.replace("200mbit}", "200mbit, delay: 2ms}"))
def test_with_delay_where_the_kernel_has_netem(fabric):
    ping = fabric.hosts["h1"].run(["ping", "-c3", "-i0.2", "198.18.0.2"])   # as subprocess.run
    assert ping.returncode == 0 and "time=" in ping.stdout, ping.stdout + ping.stderr
