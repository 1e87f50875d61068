from mlxd.cli.main import main

main()
