from services.sim.cli import main

main()
