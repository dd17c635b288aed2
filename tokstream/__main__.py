from tokstream.cli import main

main()
