"""Tool use: a ReAct-style agent loop with a calculator, choosing each action with `select`.

    python examples/react_agent.py

Each step the model writes a thought, then `select` scores the possible actions and picks
one; the program branches on the choice in plain Python (`s["action_0"]` waits for it). The
calculator's input is a gen constrained by a regex, so the tool always gets an expression it
can evaluate, even from a small model.
"""

from __future__ import annotations

import ast
import operator
from typing import Any

import sgl

ACTIONS = ["calculate", "finish"]
# One binary operation on integers: small enough that a 135M model stays inside it.
EXPRESSION = r"[0-9]{1,6} ?[-+*/] ?[0-9]{1,6}"

INSTRUCTIONS = """Solve the problem step by step. Use the calculator for arithmetic.

Question: A box holds 12 eggs. How many eggs are in 7 boxes?
Thought: I need to multiply 12 by 7.
Action: calculate
Input: 12 * 7
Observation: 84
Thought: 7 boxes hold 84 eggs.
Action: finish
Answer: 84

"""

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
              ast.Div: operator.truediv}


def calculator(expression: str) -> str:
    """Evaluate + - * / on numbers without eval(): the expression comes from a model."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        raise ValueError(f"unsupported expression: {ast.dump(node)}")

    try:
        result = value(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as exc:
        return f"error: {exc}"
    return str(int(result)) if float(result).is_integer() else f"{result:.4g}"


@sgl.function
def react_agent(s, question, max_steps=3):
    s += INSTRUCTIONS + "Question: " + question + "\n"
    steps: list[dict[str, Any]] = []
    for i in range(max_steps):
        s += "Thought:" + sgl.gen(f"thought_{i}", max_tokens=24, stop="\n") + "\n"
        s += "Action: " + sgl.select(f"action_{i}", ACTIONS) + "\n"
        step = {"thought": s[f"thought_{i}"], "action": s[f"action_{i}"]}
        steps.append(step)
        if step["action"] == "finish":
            break
        s += "Input: " + sgl.gen(f"input_{i}", max_tokens=16, regex=EXPRESSION) + "\n"
        step["input"] = s[f"input_{i}"]
        step["observation"] = calculator(step["input"])
        s += "Observation: " + step["observation"] + "\n"
    s += "Answer:" + sgl.gen("answer", max_tokens=12, stop="\n")
    return steps  # becomes state.ret_value


QUESTIONS = [
    "A train travels 45 km every hour. How far does it go in 6 hours?",
    "Tom has 120 apples and gives away 37. How many are left?",
]


def main(engine: sgl.Engine | None = None) -> list[sgl.ProgramState]:
    own = engine is None
    engine = engine or sgl.Engine()
    sgl.set_default_backend(engine)
    try:
        states = []
        for question in QUESTIONS:
            state = react_agent.run(question=question, temperature=0)
            print("Question:", question)
            for n, step in enumerate(state.ret_value):
                print(f"  step {n}: thought={step['thought'].strip()!r} action={step['action']}", end="")
                if "input" in step:
                    print(f" input={step['input']!r} -> {step['observation']}", end="")
                print()
            print("  answer:", state["answer"].strip())
            states.append(state)
        return states
    finally:
        if own:
            engine.close()


if __name__ == "__main__":
    main()
