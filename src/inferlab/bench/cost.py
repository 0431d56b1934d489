"""--price-per-hour: what a million tokens cost at a measured throughput.

The hourly price buys the whole server for an hour, whatever it spends the time on; input and output tokens
share it by weight, an output token weighing `output_cost_ratio` input tokens (default 4, within the 3-5x
that API price lists charge for output over input, and the reason: a decode step yields one token per
sequence while a prefill step handles many). With price per second P = price_per_hour / 3600 and throughputs
I (input tokens/s) and O (output tokens/s):

    input price per token  c_in  = P / (I + ratio * O)
    output price per token c_out = ratio * c_in

so c_in * I + c_out * O = P: the two together spend the hour exactly. Two figures need no split and are given
too: the price of a million tokens of either kind (P / (I + O)) and of a thousand requests.
"""

from __future__ import annotations


def cost(price_per_hour: float, input_tokens_per_s: float, output_tokens_per_s: float, requests_per_s: float,
         output_cost_ratio: float = 4.0) -> dict | None:
    """Prices per million input, output and total tokens and per thousand requests; None with no throughput."""
    p = price_per_hour / 3600.0
    weighted = input_tokens_per_s + output_cost_ratio * output_tokens_per_s
    if weighted <= 0 or requests_per_s <= 0:
        return None
    c_in = p / weighted
    return {"price_per_hour": price_per_hour, "output_cost_ratio": output_cost_ratio,
            "input_per_million": c_in * 1e6, "output_per_million": output_cost_ratio * c_in * 1e6,
            "total_per_million": p / (input_tokens_per_s + output_tokens_per_s) * 1e6,
            "per_thousand_requests": p / requests_per_s * 1e3}


def run_cost(run: dict, price_per_hour: float, output_cost_ratio: float) -> dict | None:
    """Cost at one load point, from its measured throughput (successful requests only)."""
    t = run["throughput"]
    return cost(price_per_hour, t["input_tokens_per_s"], t["output_tokens_per_s"], t["requests_per_s"],
                output_cost_ratio)


def capacity_cost(rate: float, run: dict, price_per_hour: float, output_cost_ratio: float) -> dict | None:
    """Cost at the SLO search's capacity `rate`: the server then completes `rate` requests per second, each of
    the mean input and output tokens measured at `run` (the highest rate that met the objectives)."""
    tok = run["tokens"]
    if not tok["input"]["count"] or not tok["output"]["count"]:
        return None
    return cost(price_per_hour, rate * tok["input"]["mean"], rate * tok["output"]["mean"], rate, output_cost_ratio)
