from mlxd.worker.host import main

main()
