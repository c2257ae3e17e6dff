from drpo_openrlhf.demo.run import main

main()
