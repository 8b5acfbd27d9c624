mod mariadb;
