"""An agent with real Python tools: model -> tool calls -> tools run -> model answers.

    python examples/agent_tools.py

The tools are plain typed Python functions; `generate(messages, tools=[...])` shows them to the
model (in the chat template, or in a system message for templates without tool support, like
the default model's) and returns typed calls: `call.value` is the validated arguments, so
`tool.invoke` can run them directly. The grammar makes every call well formed, even from a
135M model: `tool_choice="required"` forces a call in the first turn, `"none"` the final answer
in text. The same loop runs in the program language (`sgl.tool_call`) in `agent_program`.
"""

from __future__ import annotations

import ast
import asyncio
import operator
from typing import Annotated, Any, Literal

from pydantic import Field

import sgl
from sgl.tools import normalize_tools

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
# Digits, spaces, parentheses and + - * / . : a bounded pattern the grammar enforces.
Expression = Annotated[str, Field(pattern=r"^[0-9][0-9 ()+*/.-]{0,30}$")]
UNITS = {("km", "mi"): 0.621371, ("mi", "km"): 1.609344, ("kg", "lb"): 2.204623, ("lb", "kg"): 0.453592}


def calculate(expression: Expression) -> str:
    """Evaluate an arithmetic expression with + - * / and parentheses."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        raise ValueError("only numbers and + - * / are allowed")

    try:  # never eval(): the expression comes from a model
        result = value(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as exc:
        return f"error: {exc}"
    return f"{result:.6g}"


def convert_units(value: Annotated[int, Field(ge=0, le=100000)], from_unit: Literal["km", "mi", "kg", "lb"],
                  to_unit: Literal["km", "mi", "kg", "lb"]) -> str:
    """Convert a distance (km, mi) or a weight (kg, lb)."""
    if from_unit == to_unit:
        return f"{value} {to_unit}"
    factor = UNITS.get((from_unit, to_unit))
    if factor is None:
        return f"error: cannot convert {from_unit} to {to_unit}"
    return f"{value * factor:.4g} {to_unit}"


TOOLS = [calculate, convert_units]
QUESTIONS = ["What is 12 * (7 + 5)?", "How many miles are 42 km?"]


async def run_agent(engine: sgl.Engine, question: str, max_turns: int = 2) -> dict[str, Any]:
    """Ask, run the tools the model calls, hand it the results, and get its answer."""
    by_name = {tool.name: tool for tool in normalize_tools(TOOLS)}  # name -> sgl.Tool (fn, arguments model)
    messages: list[dict[str, Any]] = [{"role": "user", "content": question}]
    trace: list[dict[str, Any]] = []
    for turn in range(max_turns):
        out = await engine.generate(messages, tools=TOOLS, tool_choice="required" if turn == 0 else "auto",
                                    max_new_tokens=96, temperature=0)
        if not out.tool_calls:
            break
        messages.append({"role": "assistant", "content": out.content or "", "tool_calls": [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in out.tool_calls]})
        for call in out.tool_calls:
            result = by_name[call.name].invoke(call.arguments)  # the real Python function
            trace.append({"tool": call.name, "arguments": call.arguments, "result": result})
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    answer = await engine.generate(messages, tools=TOOLS, tool_choice="none", max_new_tokens=40, temperature=0)
    return {"question": question, "calls": trace, "answer": answer.text.strip()}


@sgl.function
def agent_program(s, question):
    """The same first step in the program language: the tools in the system turn, one call."""
    s += sgl.system(sgl.tools_prompt(TOOLS))
    s += sgl.user(question)
    s += sgl.assistant(sgl.tool_call("call", tools=TOOLS, max_tokens=96))
    call = s["call"][0]
    result = {"calculate": calculate, "convert_units": convert_units}[call.name](**call.arguments)
    s += sgl.user(f"The tool returned: {result}. Answer the question in one sentence.")
    s += sgl.assistant(sgl.gen("answer", max_tokens=40))
    return {"tool": call.name, "arguments": call.arguments, "result": result}


def main(engine: sgl.Engine | None = None) -> dict[str, Any]:
    own = engine is None
    engine = engine or sgl.Engine()
    try:
        runs = [asyncio.run(run_agent(engine, q)) for q in QUESTIONS]
        for run in runs:
            print("Q:", run["question"])
            for step in run["calls"]:
                print(f"  {step['tool']}({step['arguments']}) -> {step['result']}")
            print("  A:", run["answer"])
        sgl.set_default_backend(engine)
        state = agent_program.run(question=QUESTIONS[0], temperature=0)
        print("program:", state.ret_value, "->", state["answer"].strip())
        return {"runs": runs, "program": state}
    finally:
        if own:
            engine.close()


if __name__ == "__main__":
    main()
