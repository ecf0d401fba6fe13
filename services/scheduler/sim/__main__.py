from services.scheduler.sim.cli import main

main()
