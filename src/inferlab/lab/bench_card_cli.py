"""`inferlab bench --card CARD [bench flags]`: the card's workload, load and SLOs against the server it names.

Bench measures any server and knows nothing of cards; a card is the lab's. So the top-level CLI routes a bench
command with --card here: the card becomes bench flags (card.card_bench_argv), the user's own flags follow them
(later flags win), and bench runs them. A card whose server is a command template is started here and stopped
when the run ends.
"""

from __future__ import annotations

import argparse
import sys

from inferlab.bench import cli as bench_cli
from inferlab.bench.launcher import LaunchError
from inferlab.lab.card import CardError, card_bench_argv, load_card, start_server


def main(argv: list[str]) -> int:
    """`argv`: the flags after `inferlab bench`, --card among them."""
    pick = argparse.ArgumentParser(add_help=False)
    pick.add_argument("--card", required=True)
    known, user = pick.parse_known_args(argv)
    server = None
    try:
        card = load_card(known.card)
        given_url = any(a.split("=")[0] == "--base-url" for a in user)
        if card.server.kind not in ("inferlab", "endpoint") and not given_url:
            server = start_server(card.server)
        parser = argparse.ArgumentParser(prog="inferlab bench", description="a workload card's bench run")
        bench_cli.add_arguments(parser)
        card_argv = card_bench_argv(card, base_url=server.base_url if server else None)
    except (CardError, LaunchError, ValueError) as e:
        print(f"inferlab bench: error: {e}", file=sys.stderr)
        return 2
    try:
        return bench_cli.run(parser.parse_args(card_argv + user))
    finally:
        if server is not None:
            server.stop()
