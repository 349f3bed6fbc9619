"""The two-host tests' simulated hosts: kvpush.netns, which the transfer benchmark
shares, under the name the tests import."""

from kvpush.netns import REACHABLE_SUBNETS, SUBNET, Host, TwoHosts, unavailable

__all__ = ["REACHABLE_SUBNETS", "SUBNET", "Host", "TwoHosts", "unavailable"]
