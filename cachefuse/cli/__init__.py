"""The `cachefuse` command line: one subcommand per offline job, one module per subcommand.

    cachefuse precompute   store chunks' base variants through vLLM         cli/precompute.py
    cachefuse profile      measure the loading controller's figures          cli/profile_figures.py
    cachefuse inspect      list a store's variants, stale rows and orphans   cli/inspect_store.py
    cachefuse tune-alpha   fit Cache-Craft's alpha on a validation set       cli/tune_alpha.py
    cachefuse eval         quality per selector and ratio                    cli/eval.py
    cachefuse fetch-model  the SmolLM2-135M-Instruct checkpoint, converted   cli/fetch_model.py
    cachefuse profile-layers  QCFuse's critical layers for a model        cli/profile_layers.py

cli/main.py builds the parser and is the console script's entry point. Each module declares `NAME`, `HELP` and `DESCRIPTION`, `add_arguments(parser)`, which registers its
arguments, and `run(args, parser)`, which does the work (vLLM's `entrypoints/cli` is built the same way);
arguments shared by several live in cli/args.py. Two modules are not named after their command, `profile_figures`
and `inspect_store`, so that no module of the package shadows the standard library's `profile` and
`inspect`. Bad arguments and input files end in
`parser.error` (exit status 2) before any engine starts. Importing cli/main.py loads the standard library
and cachefuse.{config, errors, jsonl} only: vllm loads when a subcommand starts an engine. This file
imports nothing: a package that imports its own modules closes a cycle with each of them.
"""
