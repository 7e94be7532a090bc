from pagellm.cli.main import main

main()
