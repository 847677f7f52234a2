from h2o_chat.app.cli import main

main()
