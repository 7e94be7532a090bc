"""`pagellm generate` and `pagellm chat`: the offline engine from the command line."""

from __future__ import annotations

from dataclasses import replace

import click

from pagellm.cli.options import config_from_options, engine_options


def sampling_options(command):
    """The sampling flags shared by generate and chat."""
    for option in reversed(
        [
            click.option(
                "--max-tokens", type=int, default=128, show_default=True, help="Tokens to generate."
            ),
            click.option(
                "--temperature", type=float, default=None, help="0 = greedy (default: the model's)."
            ),
            click.option("--top-p", type=float, default=None),
            click.option("--top-k", type=int, default=None),
            click.option(
                "--sampling-seed",
                "sample_seed",
                type=int,
                default=None,
                help="Seed of this request's sampling.",
            ),
            click.option("--stop", multiple=True, help="Stop string (repeatable)."),
        ]
    ):
        command = option(command)
    return command


def _params(llm, max_tokens, temperature, top_p, top_k, sample_seed, stop):

    params = llm.engine.default_sampling_params()
    changes = {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "top_k": top_k}
    changes = {k: v for k, v in changes.items() if v is not None}
    return replace(params, **changes, seed=sample_seed, stop=list(stop))


def _llm(options):
    """generate and chat run the model eagerly unless told otherwise (--no-enforce-eager): compiling it
    costs more start-up than a few completions gain."""
    from pagellm import LLM

    if options.get("enforce_eager") is None:
        options = {**options, "enforce_eager": True}
    config = config_from_options(options)
    return LLM(**{k: getattr(config, k) for k in config.field_names()})


@click.command()
@click.argument("prompts", nargs=-1)
@sampling_options
@engine_options()
def generate(prompts, max_tokens, temperature, top_p, top_k, sample_seed, stop, **options) -> None:
    """Complete each PROMPT (or each line of standard input) and print the completions."""
    if not prompts:
        prompts = [line.rstrip("\n") for line in click.get_text_stream("stdin") if line.strip()]
    if not prompts:
        raise click.UsageError("give at least one PROMPT (or lines on standard input)")
    llm = _llm(options)
    params = _params(llm, max_tokens, temperature, top_p, top_k, sample_seed, stop)
    for output in llm.generate(list(prompts), params, use_tqdm=False):
        click.echo(output.prompt + output.outputs[0].text)


@click.command()
@click.option("--system", default=None, help="System prompt.")
@sampling_options
@engine_options()
def chat(system, max_tokens, temperature, top_p, top_k, sample_seed, stop, **options) -> None:
    """Interactive chat with the model's chat template; replies stream as they are generated."""
    llm = _llm(options)
    params = _params(llm, max_tokens, temperature, top_p, top_k, sample_seed, stop)
    params = replace(params, output_kind="delta")
    engine = llm.engine
    messages = [{"role": "system", "content": system}] if system else []
    click.echo("Chat with the model; an empty line or Ctrl-D ends it.", err=True)
    while True:
        try:
            text = click.prompt(">", prompt_suffix=" ", default="", show_default=False)
        except (EOFError, click.Abort):
            break
        if not text.strip():
            break
        messages.append({"role": "user", "content": text})
        request_id = engine.add_request({"prompt_token_ids": llm.apply_chat_template(messages)}, params)
        reply, done = [], False
        while not done:
            for output in engine.step():
                if output.request_id == request_id:
                    delta = output.outputs[0].text
                    reply.append(delta)
                    click.echo(delta, nl=False)
                    done = output.finished
        click.echo()
        messages.append({"role": "assistant", "content": "".join(reply)})
