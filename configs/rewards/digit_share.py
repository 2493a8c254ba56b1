"""A dense toy reward for configs/qwen3_shaped.py (verl's compute_score convention): the
share of ASCII digits in the answer after the thinking block. Random-weight answers get
different small scores, so GRPO advantages are nonzero and every RL step really changes
the weights the next version's workers sample from."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    answer = solution_str.split("</think>")[-1]
    return sum(c.isdigit() for c in answer) / max(len(answer), 1)
