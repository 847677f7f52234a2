from h2o_chat.models.native import main

raise SystemExit(main())
