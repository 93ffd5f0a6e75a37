"""The tiny recipe's reward: a rule with spread, so GRPO's advantages are not all zero on a random
model (verl's GSM8K scorer gives such a model 0 everywhere, and a sync would carry unchanged
weights). 1.0 for the right answer anywhere in the response, else a small score for each digit of
the answer that appears, else 0."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    if ground_truth in solution_str:
        return 1.0
    return 0.1 * sum(1 for d in set(ground_truth) if d in solution_str)
