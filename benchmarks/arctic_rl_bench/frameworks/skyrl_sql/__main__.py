from skyrl_sql import main

main()
