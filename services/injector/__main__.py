from services.injector.cli import main

main()
