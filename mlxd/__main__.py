from mlxd.cli import main

main()
