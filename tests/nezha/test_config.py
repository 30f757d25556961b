"""The config object: every NEZHA_* variable read once, defaults as documented, a bad value
refused with the variable's name."""
import dataclasses

import pytest

from nezha.config import Config, Workload
from nezha.errors import ConfigError


def test_defaults_without_environment():
    c = Config.from_env({})
    assert c == Config()
    assert (c.timeout, c.system, c.notsent_lowat, c.staging_limit, c.pipe_block) == (
        30.0, "nezha", 256 << 10, 1 << 30, 2 << 20)
    assert (c.watchdog_ms, c.check_timeout_ms, c.heartbeat_ms, c.heartbeat_timeout_ms) == (
        20.0, 100.0, 250.0, 1500.0)
    assert c.link_events and not (c.log_ops or c.store_external or c.debug_samples or c.trace)
    assert c.hedge               # late shares are copied unless NEZHA_HEDGE=0
    assert c.rank is None and c.sockbuf is None and c.tcp_user_timeout_ms is None


def test_values_are_typed():
    c = Config.from_env({"NEZHA_RANK": "2", "NEZHA_WORLD_SIZE": "4", "NEZHA_TIMEOUT": "7.5",
                         "NEZHA_PIPE_BLOCK": "4096", "NEZHA_WATCHDOG_MS": "25",
                         "NEZHA_MASTER_ADDR": "10.0.0.1", "NEZHA_MASTER_PORT": "29500",
                         "NEZHA_RAILS": "10.0.0.1,10.1.0.1", "NEZHA_TCP_CONGESTION": "cubic"})
    assert (c.rank, c.world_size, c.timeout, c.pipe_block, c.watchdog_ms) == (2, 4, 7.5, 4096, 25.0)
    assert (c.master_addr, c.master_port, c.rails, c.tcp_congestion) == (
        "10.0.0.1", 29500, "10.0.0.1,10.1.0.1", "cubic")


def test_flags_keep_their_historic_meaning():
    on = Config.from_env({"NEZHA_LOG_OPS": "1", "NEZHA_STORE_EXTERNAL": "1",
                          "NEZHA_LINK_EVENTS": "0", "NEZHA_DEBUG_SAMPLES": "yes",
                          "NEZHA_TRACE": "1", "NEZHA_HEDGE": "1"})
    assert on.log_ops and on.store_external and not on.link_events
    assert on.debug_samples and on.trace and on.hedge
    off = Config.from_env({"NEZHA_LOG_OPS": "yes", "NEZHA_STORE_EXTERNAL": "true",
                           "NEZHA_LINK_EVENTS": "1", "NEZHA_HEDGE": "0"})
    assert not off.log_ops and not off.store_external and off.link_events and not off.hedge


def test_empty_counts_as_unset_and_zero_means_default():
    c = Config.from_env({"NEZHA_TIMEOUT": "", "NEZHA_SOCKBUF": "0", "NEZHA_STAGING_LIMIT": "0",
                         "NEZHA_TCP_USER_TIMEOUT_MS": "0", "NEZHA_NOTSENT_LOWAT": "0"})
    assert c.timeout == 30.0 and c.sockbuf is None and c.staging_limit == 1 << 30
    assert c.tcp_user_timeout_ms is None and c.notsent_lowat == 0


@pytest.mark.parametrize("name, value", [("NEZHA_RANK", "one"), ("NEZHA_TIMEOUT", "fast"),
                                         ("NEZHA_HEARTBEAT_MS", "1e"),
                                         ("NEZHA_PIPE_BLOCK", "2M"), ("NEZHA_SHARES", "3,x"),
                                         ("NEZHA_SHARES", "3,-1"), ("NEZHA_SHARES", "0,0"),
                                         ("NEZHA_RAIL_CPU_US", "-5"), ("NEZHA_RAIL_CPU_US", "x"),
                                         ("NEZHA_TCP_RTO_MIN_MS", "-1"),
                                         ("NEZHA_TCP_RTO_MIN_MS", "250")])
def test_a_bad_value_names_its_variable(name, value):
    with pytest.raises(ConfigError, match=f"{name}='{value}'"):
        Config.from_env({name: value})


def test_the_rail_cpu_cost_reaches_the_balancer():
    from nezha import Context, balance
    from nezha.testing import free_port
    assert Config.from_env({}).rail_cpu_us * 1e-6 == balance.RAIL_CPU_S
    cfg = Config.from_env({"NEZHA_RAIL_CPU_US": "0"})
    cfg = dataclasses.replace(cfg, rank=0, world_size=1, rails="127.0.0.1",
                              master_addr="127.0.0.1", master_port=free_port())
    with Context(config=cfg) as ctx:
        bal = ctx.balancer
        assert bal.rs.overhead == 0.0 and bal.local_table()[0, balance.OVERHEAD_COLUMN] == 0.0


def test_pinned_shares_are_proportions_per_rail():
    assert Config.from_env({"NEZHA_SHARES": "3,1,0.5"}).shares == (3.0, 1.0, 0.5)
    assert Config.from_env({}).shares is None


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Config().timeout = 1.0


def test_workload_defaults_and_values():
    assert Workload.from_env({}) == Workload(size="16M", warmup="0", dtype="float32", op="sum")
    w = Workload.from_env({"NEZHA_SIZE": "4K", "NEZHA_ITERATIONS": "3", "NEZHA_OP": "max",
                           "NEZHA_MASTER": "h:1", "NEZHA_RESULTS": "r.jsonl"})
    assert (w.size, w.iterations, w.op, w.master, w.results) == ("4K", "3", "max", "h:1", "r.jsonl")


def test_every_variable_read_is_in_the_table():
    """The module docstring's table lists every variable the code reads."""
    import re
    import nezha.config as cfg
    src = open(cfg.__file__).read()
    body = src.split('"""', 2)[2]
    read = set(re.findall(r'"(NEZHA_[A-Z_]+)"', body))
    table = set(re.findall(r"^(NEZHA_[A-Z_]+) ", cfg.__doc__, re.M))
    assert read and read <= table, read - table
    assert table - read == {"NEZHA_RAIL_NAMES"}, table - read   # no row for a variable gone


def test_no_other_module_reads_the_environment():
    """config.py is the only reader, so a variable cannot mean two things in two modules."""
    import re
    from pathlib import Path
    import nezha
    reads = re.compile(r"environ\.get|getenv|environ\[[^]]*\](?!\s*=[^=])")
    for path in Path(nezha.__file__).parent.rglob("*.py"):
        if path.name != "config.py":
            assert not reads.search(path.read_text()), path


def _env_for_one_rank(monkeypatch, **extra):
    from nezha.testing import free_port
    env = {"NEZHA_MASTER_ADDR": "127.0.0.1", "NEZHA_MASTER_PORT": str(free_port()),
           "NEZHA_RANK": "0", "NEZHA_WORLD_SIZE": "1", "NEZHA_RAILS": "127.0.0.1", **extra}
    for k, v in env.items():
        monkeypatch.setenv(k, v)


def test_context_takes_the_environment_and_arguments_win(monkeypatch):
    from nezha import Context
    from nezha.testing import free_port
    _env_for_one_rank(monkeypatch, NEZHA_TIMEOUT="7", NEZHA_SYSTEM="stripe")
    with Context() as ctx:
        assert (ctx.system, ctx.timeout, ctx.rank, ctx.world_size) == ("stripe", 7.0, 0, 1)
    with Context(timeout=5, system="single", master=f"127.0.0.1:{free_port()}") as ctx:
        assert (ctx.system, ctx.timeout) == ("single", 5.0)


def test_a_given_config_replaces_the_environment(monkeypatch):
    from nezha import Context
    from nezha.testing import free_port
    # refused if read (see test_a_bad_value_names_its_variable)
    monkeypatch.setenv("NEZHA_TIMEOUT", "fast")
    monkeypatch.setenv("NEZHA_SYSTEM", "bogus")
    cfg = Config(rank=0, world_size=1, rails="127.0.0.1", master_addr="127.0.0.1",
                 master_port=free_port(), timeout=4.0)
    with Context(config=cfg) as ctx:
        assert (ctx.system, ctx.timeout) == ("nezha", 4.0)


def test_context_refuses_a_bad_variable_by_name(monkeypatch):
    from nezha import Context
    _env_for_one_rank(monkeypatch, NEZHA_HEARTBEAT_MS="often")
    with pytest.raises(ConfigError, match="NEZHA_HEARTBEAT_MS='often'"):
        Context()
