from cloudtrain.commands.main import main

main()
