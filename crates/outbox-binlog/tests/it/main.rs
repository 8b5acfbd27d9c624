mod mariadb;
mod seat;
