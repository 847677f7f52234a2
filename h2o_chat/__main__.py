from h2o_chat.cli import main

main()
